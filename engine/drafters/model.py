"""Draft with a separately loaded small model that shares the target's tokenizer.

The draft samples each token with the same per-position Gumbel noise as the target (the
coupled rule), so wherever the two models agree on the distribution they pick the same
token. Its KV cache follows the committed context via `sync_cache`, which also gives
prefix reuse across chat turns.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.cache import make_caches
from engine.drafters.base import Draft, sync_cache
from engine.sampling import SamplingParams, log_probs, sample_categorical, sample_coupled
from engine.verify import draft_key


class ModelDrafter:
    """A small LM as drafter. `cached_ids` mirrors what its KV cache holds."""

    name = "model"

    def __init__(self, model, n_layers: int | None = None, caches=None,
                 vocab_size: int | None = None) -> None:
        """`vocab_size`: the target's; the draft never proposes ids beyond it (padding)."""
        self.model = model
        self.vocab_size = vocab_size
        args = getattr(model, "args", None)  # wrapped models in tests may not expose it
        self._draft_vocab: int | None = args.vocab_size if args is not None else None
        self.n_layers = n_layers
        self.caches = caches if caches is not None else make_caches(model.n_layers)
        self.cached_ids: list[int] = []

    def safe_ids(self, ids: mx.array) -> mx.array:
        """Ids the draft's embedding has: a target-only id reads as 0 (it only costs
        draft quality; verification decides what is committed)."""
        if self._draft_vocab is None:
            return ids
        return mx.where(ids < self._draft_vocab, ids, 0)

    def _run(self, ids: mx.array, cache=None) -> mx.array:
        """The draft model with this drafter's layer limit (layer skip: the first layers)."""
        return self.model(self.safe_ids(ids), cache=cache, n_layers=self.n_layers)

    def _forward(self, ids: mx.array) -> mx.array:
        logits = self._run(ids, self.caches)[0]
        return logits if self.vocab_size is None else logits[:, : self.vocab_size]

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                accept: str) -> Draft:
        """Run k autoregressive draft steps as one lazy graph, evaluated once at the end."""
        if k <= 0:
            return Draft(())
        self.commit(context)
        logits = self._forward(mx.array([[context[-1]]]))[-1:]  # (1, V)
        want_history = sampling.repetition_penalty != 1.0
        history = list(context)
        t = len(context)
        ids: list[mx.array] = []
        logqs: list[mx.array] = []
        for i in range(k):
            lq = log_probs(logits, sampling, [history] if want_history else None)
            if accept == "coupled" or sampling.greedy:
                tok = sample_coupled(lq, sampling.seed, [t + i])
            else:
                tok = sample_categorical(mx.exp(lq), draft_key(sampling.seed, t + i))
            ids.append(tok)
            logqs.append(lq)
            if want_history:
                history.append(int(tok.item()))
            if i < k - 1:
                logits = self._forward(tok[None])[-1:]
        drafted = mx.concatenate(ids)
        logq = mx.concatenate(logqs)
        mx.eval(drafted, logq)
        out = tuple(int(x) for x in drafted.tolist())
        self.cached_ids = list(context) + list(out[:-1])
        return Draft(out, logq)

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

