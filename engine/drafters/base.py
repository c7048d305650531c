"""The `Drafter` protocol: anything that can guess the target's next tokens cheaply.

A drafter proposes up to k tokens after a committed context and, where it has them, its
own distributions q (for the rejection rule). After verification `commit` tells it the new
committed context so it can cut its own state back (or catch up) to match.
"""

from __future__ import annotations

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
    a chain, the degenerate tree. `gaps`, per node, how many tokens shorter the earlier
    match a prompt-lookup branch copies is than the chain's (None for the chain's nodes);
    the tree policy prices each branch by it. `conf`, per node, a model drafter's own
    chance for the node's token where its parent is reached (the softmax of the scores it
    drew by); the tree policy prices each node by it, calibrated.
    """

    ids: tuple[int, ...]
    logq: mx.array | None = None
    parents: tuple[int, ...] | None = None
    gaps: tuple[float | None, ...] | None = None
    conf: tuple[float, ...] | None = None

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


def draw_scores(raw: mx.array, logq: mx.array, sampling: SamplingParams,
                positions: Sequence[int], columns: mx.array | None = None) -> mx.array:
    """The scores (n, cols) a coupled draw takes the argmax of, one row per position: at
    T = 0 the drafter's raw logits (q is one-hot there, and the softmax of these is the
    drafter's own distribution), else log q plus the position's noise (over `columns`'
    ids where the drafter has its own columns). The softmax of a row is how sure the
    draw was of each token (`Draft.conf`)."""
    if sampling.greedy:
        return raw.astype(mx.float32)
    noise = (gumbel_noise(sampling.seed, positions, logq.shape[-1]) if columns is None
             else gumbel_noise_at(sampling.seed, positions, columns))
    return logq.astype(mx.float32) + noise


def draft_tokens(logits: mx.array, step: Callable[[mx.array], mx.array],
                 context: Sequence[int], k: int, sampling: SamplingParams,
                 accept: str, vocab: mx.array | None = None,
                 until: Callable[[Sequence[float]], bool] | None = None) -> DraftRun:
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

    `until` (coupled rule only): after each token, given the confidences of the tokens
    drawn so far (`draw_scores`), whether to draw one more; each step is then evaluated
    on its own, so a chain the drafter is unsure of stops before its draft steps are spent.
    """
    want_history = sampling.repetition_penalty != 1.0
    if vocab is not None and want_history:
        raise ValueError("a repetition penalty needs logits over the whole vocabulary")
    if until is not None and (accept != "coupled" or want_history):
        raise ValueError("an early stop reads the coupled draw's scores, without a penalty")

    def token_ids(columns: mx.array) -> mx.array:
        return (columns if vocab is None else mx.take(vocab, columns)).astype(mx.int32)

    history = list(context)
    t = len(context)
    ids: list[mx.array] = []
    logqs: list[mx.array] = []
    raw: list[mx.array] = []
    confs: list[float] = []
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
        if until is not None:
            # the drawn token is the scores' argmax: its confidence is the top share
            sure = mx.max(mx.softmax(draw_scores(logits, lq, sampling, [t + i], vocab),
                                     axis=-1))
            mx.eval(tok, sure)
            confs.append(float(sure.item()))
            if not until(confs):
                break
        if i < k - 1:
            logits = step(tok)
    drafted = mx.concatenate(ids)
    logq = mx.concatenate(logqs)
    mx.eval(drafted)
    return DraftRun(tuple(int(x) for x in drafted.tolist()), logq, tuple(raw), vocab)


# alternatives a tree may offer per depth (depth 1 four, depth 2 two): the tree policy keeps
# those whose own chance pays for their rows. Priced alike by a score gap, wider offers had
# made trees slower on the demo with its head (a row for every close call, right or not).
RUNNER_UPS = (4, 2)


def with_runner_ups(chain: Draft, run: DraftRun | None, n_context: int,
                    sampling: SamplingParams, accept: str, extra: int) -> Draft:
    """`chain` (drawn by `draft_tokens` as `run`) plus, within `extra` nodes, the runner-ups
    (`RUNNER_UPS` at each shallow depth) as leaves beside the chain's node there, every
    node with the drafter's confidence in it (`Draft.conf`).

    Under the coupled rule the chain's token is the argmax of the draft's scores (log q
    plus the position's noise); the runner-ups are the next ones, and where the draft's
    pick is wrong they are the likeliest target choices. A node's confidence is its share
    of the softmax of those scores (at T = 0 the drafter's own probability): EAGLE-2's
    observation that a draft's confidence predicts acceptance holds for the demo's head
    (at T = 0, first-depth picks it gave under 20% were accepted 3% of the time, over 90%
    at 90-100%), so the tree policy prices each node by it, and a leaf costs a verify row
    but no draft step. Coupled rule only; ids the drafter cannot propose (-inf, or outside
    a head's hot vocabulary) are never added. Scored over the run's own columns where it
    has them, with the noise of their ids: the same leaves and confidences as over the
    whole vocabulary, without a pass over it.
    """
    k = len(chain.ids)
    if extra <= 0 or accept != "coupled" or chain.logq is None or not k or run is None:
        return chain
    columns = run.columns
    scores = draw_scores(mx.concatenate(run.logits[:k]), run.logq[:k], sampling,
                         list(range(n_context, n_context + k)), columns)
    shares = mx.softmax(scores, axis=-1)
    most = max(RUNNER_UPS)
    top = mx.argpartition(-scores, most, axis=-1)[:, : most + 1]
    picked = mx.array(chain.ids)[:, None]
    if columns is not None:  # each pick's column
        picked = mx.argmax(columns[None, :] == picked, axis=-1, keepdims=True)
    own = mx.take_along_axis(shares, picked, axis=-1)[:, 0]
    finite = mx.isfinite(mx.take_along_axis(scores, top, axis=-1))
    rival = mx.take_along_axis(shares, top, axis=-1)
    if columns is not None:
        top = mx.take(columns, top)
    mx.eval(top, rival, own, finite)  # one host sync
    conf = tuple(own.tolist())
    leaves: list[tuple[int, float, int]] = []  # (depth, confidence, token)
    shallow = len(RUNNER_UPS)
    for depth, (toks, shares_, ok) in enumerate(
            zip(top.tolist()[:shallow], rival.tolist()[:shallow], finite.tolist()[:shallow],
                strict=True), start=1):
        ranked = sorted(((c, t) for c, t, f in zip(shares_, toks, ok, strict=True)
                         if t != chain.ids[depth - 1] and f), reverse=True)
        leaves += [(depth, c, t) for c, t in ranked[: RUNNER_UPS[depth - 1]]]
    leaves = leaves[:extra]
    n = len(chain.ids)
    if not leaves:
        return Draft(chain.ids, chain.logq, None, None, conf)
    # depth-first: the chain, then the leaves from the deepest fork up (likeliest first)
    leaves.sort(key=lambda leaf: (-leaf[0], -leaf[1]))
    ids = [*chain.ids, *(tok for _, _, tok in leaves)]
    parents = [*range(-1, n - 1), *(depth - 2 for depth, _, _ in leaves)]
    rows = mx.array([*range(n), *(depth - 1 for depth, _, _ in leaves)])
    tree = DraftTree(tuple(ids), tuple(parents))
    return Draft(tree.ids, chain.logq[rows], tree.parents, None,
                 (*conf, *(c for _, c, _ in leaves)))


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
