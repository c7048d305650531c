"""The `Drafter` protocol: anything that can guess the target's next tokens cheaply.

A drafter proposes up to k tokens after a committed context and, where it has them, its
own distributions q (for the rejection rule). After verification `commit` tells it the new
committed context so it can cut its own state back (or catch up) to match.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from engine.cache import KVCache, cache_length, shared_length, trim_caches, usable_length
from engine.models.attention import inference_pass
from engine.sampling import (
    SamplingParams,
    gumbel_noise,
    gumbel_noise_at,
    log_probs,
    sample_categorical,
    sample_coupled,
    sample_coupled_at,
)
from engine.steps import chunk_rows
from engine.tree import DraftTree
from engine.verify import draft_key


@dataclass(frozen=True)
class Draft:
    """Proposed tokens and, for model drafters, their log-distributions (n, V).

    `logq` None means the drafter is deterministic: verification treats q as one-hot.
    `parents` makes the tokens a draft tree (depth-first, `engine.tree.DraftTree`); None is
    a chain, the degenerate tree. `gaps`, per node, how far below its older sibling a
    runner-up scored under the same noise (None for a node without a score: the chain's,
    prompt lookup's); the tree policy prices each branch by it.
    """

    ids: tuple[int, ...]
    logq: mx.array | None = None
    parents: tuple[int, ...] | None = None
    gaps: tuple[float | None, ...] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def tree(self) -> DraftTree:
        if self.parents is None:
            return DraftTree.chain(self.ids)
        return DraftTree(tuple(self.ids), tuple(self.parents))


@dataclass(frozen=True)
class DraftRun:
    """What `draft_tokens` drew: the tokens, their log-distributions q (k, n) and the raw
    logits of each depth (1, n) before the sampling processors (tree sources read them).

    Over the whole vocabulary (n = V) where `columns` is None, else over the drafter's own
    columns, token `columns[j]` in column j (a head's hot vocabulary): lifting them to the
    vocabulary costs more than the head step that made them (~0.4 ms a row here), so only
    what reads q over the vocabulary (the rejection rule) lifts it."""

    ids: tuple[int, ...]
    logq: mx.array
    logits: tuple[mx.array, ...]
    columns: mx.array | None = None


def draft_tokens(logits: mx.array, step: Callable[[mx.array], mx.array],
                 context: Sequence[int], k: int, sampling: SamplingParams,
                 accept: str, vocab: mx.array | None = None) -> DraftRun:
    """The one autoregressive draft loop: k tokens after `context` as one lazy graph,
    evaluated once at the end.

    `logits` (1, V) is the drafter's prediction for position len(context); `step(tok)`
    feeds the drawn token (shape (1,)) to the drafter and returns its logits (1, V) for the
    next position (a draft model runs its LM, a head its own output state). Each token is
    drawn with the target's coupled noise at its absolute position (or, under the rejection
    rule at T > 0, from q with the position's draft key), so a draft that agrees with the
    target picks the target's own token; q is recorded for the rejection rule.

    A drafter with a small output vocabulary passes logits over it and `vocab` (its columns'
    token ids): tokens are drawn over those columns alone, with the noise of their ids,
    which draws the very tokens the rows lifted to the whole vocabulary (-inf elsewhere)
    would; q and the logits are returned over the columns (`DraftRun.columns`). No
    repetition penalty: its history holds token ids, not columns.
    """
    want_history = sampling.repetition_penalty != 1.0
    if vocab is not None and want_history:
        raise ValueError("a repetition penalty needs logits over the whole vocabulary")

    def token_ids(columns: mx.array) -> mx.array:
        return (columns if vocab is None else mx.take(vocab, columns)).astype(mx.int32)

    history = list(context)
    t = len(context)
    ids: list[mx.array] = []
    logqs: list[mx.array] = []
    raw: list[mx.array] = []
    for i in range(k):
        raw.append(logits)
        lq = log_probs(logits, sampling, [history] if want_history else None)
        if sampling.greedy:
            # a one-hot row's coupled sample is its argmax: no noise over the vocabulary
            tok = token_ids(mx.argmax(lq, axis=-1))
        elif accept == "coupled":
            tok = (sample_coupled(lq, sampling.seed, [t + i]) if vocab is None
                   else sample_coupled_at(lq, sampling.seed, [t + i], vocab))
        else:
            tok = token_ids(sample_categorical(mx.exp(lq), draft_key(sampling.seed, t + i)))
        ids.append(tok)
        logqs.append(lq)
        if want_history:
            history.append(int(tok.item()))
        if i < k - 1:
            logits = step(tok)
    drafted = mx.concatenate(ids)
    logq = mx.concatenate(logqs)
    mx.eval(drafted)
    return DraftRun(tuple(int(x) for x in drafted.tolist()), logq, tuple(raw), vocab)


# alternatives a tree may offer per depth (depth 1 two, depth 2 one). Deeper or wider offers
# raised tau on tiny models, but on the demo with its head they widened passes into the
# part of this CPU's cost curve the table prices too cheaply, and trees got slower.
RUNNER_UPS = (2, 1)


def with_runner_ups(chain: Draft, run: DraftRun | None, n_context: int,
                    sampling: SamplingParams, accept: str, extra: int) -> Draft:
    """`chain` (drawn by `draft_tokens` as `run`) plus, within `extra` nodes, the runner-ups
    (`RUNNER_UPS` at each shallow depth) as leaves beside the chain's node there.

    Under the coupled rule the chain's token is the argmax of the draft's scores (log q
    plus the position's noise); the runner-ups are the next ones, and where the draft's
    pick is wrong they are the likeliest target choices. Each carries its gap below the
    chain's token (EAGLE-2 style: a close call is a likely win) so the policy can price
    it; a leaf costs a verify row but no draft step. Coupled rule only; ids the drafter
    cannot propose (-inf, or outside a head's hot vocabulary) are never added. Scored
    over the run's own columns where it has them, with the noise of their ids: the same
    leaves as over the whole vocabulary, without a pass over it.
    """
    k = min(len(chain.ids), len(RUNNER_UPS))
    if extra <= 0 or accept != "coupled" or chain.logq is None or not k or run is None:
        return chain
    columns = run.columns
    positions = list(range(n_context, n_context + k))
    if sampling.greedy:  # q is one-hot: the runner-ups come from the drafter's logits
        # (a gap between two logits of a row is their log-probability ratio: no softmax)
        scores = mx.concatenate([r.astype(mx.float32) for r in run.logits[:k]])
    elif columns is None:
        scores = run.logq[:k].astype(mx.float32) + gumbel_noise(
            sampling.seed, positions, run.logq.shape[-1])
    else:
        scores = run.logq[:k].astype(mx.float32) + gumbel_noise_at(
            sampling.seed, positions, columns)
    most = max(RUNNER_UPS)
    top = mx.argpartition(-scores, most, axis=-1)[:, : most + 1]
    picked = mx.array(chain.ids[:k])[:, None]
    if columns is not None:  # each pick's column
        picked = mx.argmax(columns[None, :] == picked, axis=-1, keepdims=True)
    best = mx.take_along_axis(scores, picked, axis=-1)
    gap = best - mx.take_along_axis(scores, top, axis=-1)
    if columns is not None:
        top = mx.take(columns, top)
    mx.eval(top, gap)  # one host sync for both
    leaves: list[tuple[int, float, int]] = []  # (depth, gap, token)
    for depth, (toks, gaps) in enumerate(zip(top.tolist(), gap.tolist(), strict=True),
                                         start=1):
        ranked = sorted((g, t) for g, t in zip(gaps, toks, strict=True)
                        if t != chain.ids[depth - 1] and math.isfinite(g))
        leaves += [(depth, max(g, 0.0), t) for g, t in ranked[: RUNNER_UPS[depth - 1]]]
    leaves = leaves[:extra]
    if not leaves:
        return chain
    # depth-first: the chain, then the leaves from the deepest fork up (closest call first)
    leaves.sort(key=lambda leaf: (-leaf[0], leaf[1]))
    n = len(chain.ids)
    ids = [*chain.ids, *(tok for _, _, tok in leaves)]
    parents = [*range(-1, n - 1), *(depth - 2 for depth, _, _ in leaves)]
    rows = mx.array([*range(n), *(depth - 1 for depth, _, _ in leaves)])
    tree = DraftTree(tuple(ids), tuple(parents))
    return Draft(tree.ids, chain.logq[rows], tree.parents,
                 (*(None,) * n, *(g for _, g, _ in leaves)))


class Drafter(Protocol):
    """What the speculative loop needs from a drafter."""

    name: str

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                accept: str) -> Draft:
        """Guess up to `k` tokens following `context` (the whole committed sequence)."""
        ...

    def commit(self, context: Sequence[int]) -> None:
        """Bring internal state in line with the committed `context`."""
        ...

    def reset(self) -> None:
        """Forget every cached state (a new conversation)."""
        ...


def sync_cache(model, caches: Sequence[KVCache], cached_ids: list[int],
               context: Sequence[int]) -> tuple[list[int], mx.array | None]:
    """Make `caches` hold exactly `context[:-1]`, reusing the longest shared prefix.

    Returns the new cached ids and, when tokens had to be fed, the logits of the last fed
    token (None otherwise). This is how a draft model catches up the target's replaced or
    bonus token, and how its cache survives across chat turns.
    """
    want = list(context[:-1])
    n = usable_length(caches, shared_length(cached_ids[: cache_length(caches)], want))
    trim_caches(caches, n)
    logits = None
    while n < len(want):  # in a prompt's chunks: a long prompt at once held every score
        end = min(n + chunk_rows(n), len(want))
        with inference_pass():  # as the target's prompt chunks (`steps.prefill`)
            logits = model(mx.array([want[n:end]]), cache=list(caches), last_only=True)[0]
        if end < len(want):
            mx.eval(logits)
        n = end
    return want, logits
