"""Draft with a separately loaded small model that shares the target's tokenizer.

The draft samples each token with the same per-position Gumbel noise as the target (the
coupled rule), so wherever the two models agree on the distribution they pick the same
token. Its KV cache follows the committed context via `sync_cache`, which also gives
prefix reuse across chat turns.

As a tree source (`propose_tree`, coupled rule only) it adds the draft's runner-ups at the
shallow depths as sibling leaves (EAGLE-2 style): under the same noise, the next-best token
is the likeliest target choice where the draft's own pick is wrong, and a leaf costs a
verify row but no draft pass. Every node carries the draft's confidence in it, by which
`engine.tree_policy.prune_draft` keeps those that pay, and a chain it is unsure of stops
early (`until`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from engine.cache import model_caches
from engine.drafters.base import Draft, DraftRun, draft_tokens, sync_cache, with_runner_ups
from engine.sampling import SamplingParams


class ModelDrafter:
    """A small LM as drafter. `cached_ids` mirrors what its KV cache holds."""

    name = "model"
    stops_early = True  # `propose(until=)`: a chain it is unsure of ends early

    def __init__(self, model, n_layers: int | None = None, caches=None,
                 vocab_size: int | None = None) -> None:
        """`vocab_size`: the target's; the draft never proposes ids beyond it (padding)."""
        self.model = model
        self.vocab_size = vocab_size
        args = getattr(model, "args", None)  # wrapped models in tests may not expose it
        self._draft_vocab: int | None = args.vocab_size if args is not None else None
        self.n_layers = n_layers
        self.caches = caches if caches is not None else model_caches(model)
        self.cached_ids: list[int] = []
        self._drawn: DraftRun | None = None  # the last proposal's draw

    def safe_ids(self, ids: mx.array) -> mx.array:
        """Ids the draft's embedding has: a target-only id reads as 0 (it only costs
        draft quality; verification decides what is committed)."""
        if self._draft_vocab is None:
            return ids
        return mx.where(ids < self._draft_vocab, ids, 0)

    def _run(self, ids: mx.array, cache=None, last_only: bool = False) -> mx.array:
        """The draft model with this drafter's layer limit (layer skip: the first layers)."""
        if last_only:
            return self.model(self.safe_ids(ids), cache=cache, n_layers=self.n_layers,
                              last_only=True)
        return self.model(self.safe_ids(ids), cache=cache, n_layers=self.n_layers)

    def _forward(self, ids: mx.array) -> mx.array:
        logits = self._run(ids, self.caches)[0]
        return logits if self.vocab_size is None else logits[:, : self.vocab_size]

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                accept: str, until: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        """Run k autoregressive draft steps as one lazy graph, evaluated once at the end
        (or a step at a time, fewer where `until` stops them: `draft_tokens`)."""
        if k <= 0:
            return Draft(())
        self.commit(context)
        first = self._forward(mx.array([[context[-1]]]))[-1:]  # (1, V)
        run = draft_tokens(first, lambda tok: self._forward(tok[None])[-1:], context, k,
                           sampling, accept, until=until)
        self._drawn = run
        self.cached_ids = list(context) + list(run.ids[:-1])
        return Draft(run.ids, run.logq)

    def propose_tree(self, context: Sequence[int], k: int, extra: int,
                     sampling: SamplingParams | None = None, accept: str = "coupled",
                     until: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        """The chain `propose` drafts plus, within `extra` nodes, the runner-ups under the
        same noise at depths 1..len(RUNNER_UPS) as leaves beside the chain's node there."""
        sampling = sampling or SamplingParams()
        chain = self.propose(context, k, sampling, accept, until)
        return with_runner_ups(chain, self._drawn, len(context), sampling, accept, extra)

    def commit(self, context: Sequence[int]) -> None:
        """Hold exactly `context[:-1]`: trim rejected drafts, feed accepted-but-unfed ones."""
        self.cached_ids, logits = sync_cache(self._run, self.caches, self.cached_ids,
                                             context)
        if logits is not None:
            mx.eval(logits)

    def reset(self) -> None:
        self.cached_ids = []
        for c in self.caches:
            c.trim(0)

