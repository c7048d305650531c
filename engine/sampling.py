"""Logits → sampling distribution, and the per-position seeded sampler.

Two halves:

* **Distribution.** `log_probs` turns logits (N, V) into float32 log-probabilities after the
  processors, in this fixed order: repetition penalty (on raw logits, over each row's recent
  history), temperature, top-k, top-p, min-p. Masked tokens get -inf. Greedy (temperature 0)
  is returned as a deterministic one-hot distribution, so speculative verification can treat
  every setting as "a distribution" without a special case.
* **Coupled sampling.** `sample_coupled` picks argmax(log p_t + g_t), where the Gumbel noise
  g_t is a pure function of (seed, absolute position t, vocab index): a counter-based integer
  hash, not a stateful RNG. So the token at position t depends only on the distribution at t,
  the seed and t — plain decoding, drafting and verification all draw the same token from the
  same distribution, whatever the batch shape. That is what makes speculative decoding
  token-identical to plain decoding under the "coupled" acceptance rule. The noise and the
  sampler itself live in `kernels/` (`kernels.noise`, `kernels.verify_sampler`): the engine
  reaches them through `kernels.dispatch`, which runs a fused Metal kernel where the device
  passed its self-test and the pure-MLX reference everywhere else. `coupled_rows` is the
  engine's entry: processors the kernel does not cover (penalty, top-k, top-p, min-p) run
  first as MLX ops, in `log_probs`'s order.

`sample_categorical` and `residual_distribution` serve the "rejection" (Leviathan/Chen) rule.

Every processor is a small pure callable made by a factory (`make_*`), so tests and other
modules can use each step alone. The hot path is `mx.compile`d (once per parameter set), but
only on the main thread: see `kernels.compile.compiled_on_main_thread`. Compiled and eager results are
bit-identical on CPU (checked), so the thread changes speed, never tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from engine.errors import EngineError
from kernels import dispatch
from kernels.compile import compiled_on_main_thread
from kernels.noise import gumbel_noise as gumbel_noise  # re-exported: the coupled noise
from kernels.noise import gumbel_noise_at as gumbel_noise_at  # re-exported with gumbel_noise
from kernels.noise import keys_array, positions_u32
from kernels.noise import noise_bits as noise_bits
from kernels.verify_sampler import LOG_PROBS, SampledRows, SamplerSpec, log_softmax

Processor = Callable[[mx.array], mx.array]
"""Maps float32 scores (N, V) to scores (N, V); masked tokens are -inf."""

@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a token. temperature == 0 means greedy (argmax).

    top_k == 0, top_p == 1.0, min_p == 0.0 and repetition_penalty == 1.0 each switch their
    processor off. The repetition penalty looks at the last `repetition_context_size` tokens
    of a row's history (prompt included). `seed` selects the coupled sampler's noise.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        _check_real("temperature", self.temperature, lambda v: v >= 0.0, ">= 0")
        _check_int("top_k", self.top_k, lambda v: v >= 0, ">= 0 (0 = off)")
        _check_real("top_p", self.top_p, lambda v: 0.0 < v <= 1.0, "in (0, 1] (1 = off)")
        _check_real("min_p", self.min_p, lambda v: 0.0 <= v <= 1.0, "in [0, 1] (0 = off)")
        _check_real(
            "repetition_penalty", self.repetition_penalty, lambda v: v > 0.0, "> 0 (1 = off)"
        )
        _check_int(
            "repetition_context_size", self.repetition_context_size, lambda v: v >= 0, ">= 0"
        )
        _check_int("seed", self.seed, lambda v: 0 <= v < 2**64, "in [0, 2**64)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_real(name: str, value: object, ok: Callable[[float], bool], rule: str) -> None:
    valid = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and ok(value)
    )
    if not valid:
        raise EngineError(f"sampling {name} must be a finite number {rule}, got {value!r}")


def _check_int(name: str, value: object, ok: Callable[[int], bool], rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise EngineError(f"sampling {name} must be an integer {rule}, got {value!r}")


# --------------------------------------------------------------------------- processors


def make_repetition_penalty(
    penalty: float, context_size: int
) -> Callable[[mx.array, Sequence[Sequence[int]]], mx.array]:
    """Penalize tokens seen in each row's last `context_size` history tokens.

    A seen token's logit is divided by `penalty` when positive and multiplied when negative
    (the CTRL rule), so penalty > 1 always makes it less likely. Row i uses histories[i]; ids
    outside [0, V) are ignored.
    """

    def apply(logits: mx.array, histories: Sequence[Sequence[int]]) -> mx.array:
        n_rows, vocab = logits.shape
        if len(histories) != n_rows:
            raise ValueError(f"{len(histories)} histories for {n_rows} logit rows")
        rows: list[int] = []
        cols: list[int] = []
        for i, history in enumerate(histories):
            recent = list(history)[-context_size:] if context_size > 0 else []
            seen = {int(tok) for tok in recent if 0 <= int(tok) < vocab}
            rows.extend([i] * len(seen))
            cols.extend(sorted(seen))
        if not rows:
            return logits
        seen_mask = mx.zeros((n_rows, vocab), dtype=mx.bool_)
        seen_mask[mx.array(rows), mx.array(cols)] = True
        return _penalize(logits, seen_mask, mx.array(penalty, dtype=mx.float32))

    return apply


@compiled_on_main_thread
def _penalize(logits: mx.array, seen_mask: mx.array, penalty: mx.array) -> mx.array:
    penalized = mx.where(logits > 0, logits / penalty, logits * penalty)
    return mx.where(seen_mask, penalized, logits)


def make_temperature(temperature: float) -> Processor:
    """Divide scores by `temperature` (> 0): below 1 sharpens, above 1 flattens."""
    if temperature <= 0:
        raise ValueError("temperature processor needs temperature > 0; greedy has no scaling")
    inv = 1.0 / temperature
    return lambda scores: scores * inv


def make_top_k(k: int) -> Processor:
    """Keep the k highest scores per row (all ties at the k-th score are kept)."""

    def apply(scores: mx.array) -> mx.array:
        if k >= scores.shape[-1]:
            return scores
        kth = mx.min(mx.topk(scores, k, axis=-1), axis=-1, keepdims=True)
        return mx.where(scores >= kth, scores, -mx.inf)

    return apply


def make_top_p(p: float) -> Processor:
    """Keep the smallest set of most likely tokens whose mass reaches `p` (nucleus).

    A token is kept when the mass of the tokens strictly more likely than it is below p, so
    the token that crosses p is kept too. Mass is measured on the renormalized distribution
    of the scores it is given (i.e. after temperature and top-k).
    """

    def apply(scores: mx.array) -> mx.array:
        probs = mx.softmax(scores, axis=-1)
        ascending = mx.sort(probs, axis=-1)  # values only: the cut is a value, not an index
        # Mass of the tokens after each one in ascending order, summed from the largest down.
        mass_above = mx.cumsum(ascending, axis=-1, reverse=True) - ascending
        keep_sorted = mass_above < p
        # The kept set is a suffix of the ascending order: its smallest probability is the cut.
        cut = mx.min(mx.where(keep_sorted, ascending, mx.inf), axis=-1, keepdims=True)
        return mx.where(probs >= cut, scores, -mx.inf)

    return apply


def make_min_p(min_p: float) -> Processor:
    """Keep tokens whose probability is at least `min_p` times the most likely one's."""
    log_min_p = math.log(min_p) if min_p > 0 else -math.inf

    def apply(scores: mx.array) -> mx.array:
        top = mx.max(scores, axis=-1, keepdims=True)
        return mx.where(scores >= top + log_min_p, scores, -mx.inf)

    return apply


def make_log_softmax() -> Processor:
    """Normalize scores to log-probabilities; -inf stays -inf."""
    return lambda scores: log_softmax(scores)


def make_greedy_one_hot() -> Processor:
    """The log of the one-hot distribution at each row's argmax (0 there, -inf elsewhere)."""

    def apply(scores: mx.array) -> mx.array:
        best = mx.argmax(scores, axis=-1, keepdims=True)
        columns = mx.arange(scores.shape[-1])[None, :]
        return mx.where(columns == best, mx.array(0.0, mx.float32), -mx.inf)

    return apply


def make_processors(params: SamplingParams) -> list[Processor]:
    """The processors after the repetition penalty, in application order."""
    if params.greedy:
        return [make_greedy_one_hot()]
    chain: list[Processor] = [make_temperature(params.temperature)]
    if params.top_k > 0:
        chain.append(make_top_k(params.top_k))
    if params.top_p < 1.0:
        chain.append(make_top_p(params.top_p))
    if params.min_p > 0.0:
        chain.append(make_min_p(params.min_p))
    chain.append(make_log_softmax())
    return chain


@lru_cache(maxsize=64)
def _compiled_chain(temperature: float, top_k: int, top_p: float, min_p: float) -> Processor:
    """One compiled function per distinct setting; the parameters are baked in as constants."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    chain = make_processors(params)

    def run(scores: mx.array) -> mx.array:
        for step in chain:
            scores = step(scores)
        return scores

    return compiled_on_main_thread(run)


# --------------------------------------------------------------------------- distribution


def log_probs(
    logits: mx.array,
    params: SamplingParams,
    histories: Sequence[Sequence[int]] | None = None,
) -> mx.array:
    """Float32 log-probabilities (N, V) of the token to sample at each of N positions.

    Args:
        logits: (N, V); row i is one position (1 row for plain decoding, K+1 when verifying).
        params: the sampling settings. Greedy gives log one-hot at the (penalized) argmax.
        histories: row i's preceding token ids, for the repetition penalty; None = no penalty.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be (N, V), got shape {tuple(logits.shape)}")
    scores = logits.astype(mx.float32)
    if (
        histories is not None
        and params.repetition_penalty != 1.0
        and params.repetition_context_size > 0
    ):
        penalty = make_repetition_penalty(params.repetition_penalty, params.repetition_context_size)
        scores = penalty(scores, histories)
    chain = _compiled_chain(
        float(params.temperature), params.top_k, float(params.top_p), float(params.min_p)
    )
    return chain(scores)


def probs(
    logits: mx.array,
    params: SamplingParams,
    histories: Sequence[Sequence[int]] | None = None,
) -> mx.array:
    """The full probability vectors (N, V): exp of `log_probs`, masked tokens exactly 0."""
    return mx.exp(log_probs(logits, params, histories))


# --------------------------------------------------------------------------- coupled sampling


@dataclass(frozen=True)
class _Split:
    """How one setting divides between MLX processors and the fused sampler."""

    pre: Processor | None  # processors run as MLX ops first (top-k, top-p, min-p need them)
    spec: SamplerSpec  # what the sampler (kernel or reference) does after them


@lru_cache(maxsize=64)
def _split(temperature: float, top_k: int, top_p: float, min_p: float) -> _Split:
    """The processors after the repetition penalty, split at the point the sampler takes over.

    The order stays the one `log_probs` applies (temperature, top-k, top-p, min-p, then
    normalization): with only a temperature, the sampler scales and normalizes itself;
    otherwise the chain up to min-p runs first and the sampler normalizes its output.
    """
    if temperature == 0:
        return _Split(None, SamplerSpec(greedy=True))
    if top_k == 0 and top_p == 1.0 and min_p == 0.0:
        return _Split(None, SamplerSpec(inv_temperature=1.0 / temperature))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    chain = make_processors(params)[:-1]  # all but the final log-softmax

    def run(scores: mx.array) -> mx.array:
        for step in chain:
            scores = step(scores)
        return scores

    return _Split(compiled_on_main_thread(run), SamplerSpec())


def coupled_rows(
    logits: mx.array,
    params: SamplingParams,
    histories: Sequence[Sequence[int]] | None,
    positions: Sequence[int] | mx.array,
    draft_ids: Sequence[int] = (),
) -> SampledRows:
    """Each row's coupled sample from logits (N, V) under `params`, its probability, the
    target probability of each draft and the accepted prefix — lazily, in one sampler call.

    The same tokens as `sample_coupled(log_probs(logits, params, histories), ...)`; the
    kernels dispatcher runs it fused on the GPU where the device passed its self-test.
    Row i is position positions[i]; draft_ids[i] is the draft checked against row i.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be (N, V), got shape {tuple(logits.shape)}")
    scores = logits
    if (
        histories is not None
        and params.repetition_penalty != 1.0
        and params.repetition_context_size > 0
    ):
        penalty = make_repetition_penalty(params.repetition_penalty, params.repetition_context_size)
        scores = penalty(scores.astype(mx.float32), histories)
    split = _split(float(params.temperature), params.top_k, float(params.top_p),
                   float(params.min_p))
    if split.pre is not None:
        scores = split.pre(scores.astype(mx.float32))
    pos = positions_u32(positions)
    if pos.shape[0] != scores.shape[0]:
        raise ValueError(f"{pos.shape[0]} positions for {scores.shape[0]} rows")
    return dispatch.sample_rows(scores, keys_array(params.seed), pos, draft_ids, split.spec)


def sample_coupled(logprobs: mx.array, seed: int, positions: Sequence[int] | mx.array) -> mx.array:
    """Tokens (N,) int32: argmax(logprobs[i] + g(seed, positions[i])) per row.

    This is an exact sample from each row's distribution (the Gumbel-max trick), and it is
    the same token wherever the same distribution meets the same (seed, t): plain decoding,
    drafting and verification. A one-hot (greedy) row returns its argmax.
    """
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be (N, V), got shape {tuple(logprobs.shape)}")
    pos = positions_u32(positions)
    if pos.shape[0] != logprobs.shape[0]:
        raise ValueError(f"{pos.shape[0]} positions for {logprobs.shape[0]} rows")
    return dispatch.sample_rows(logprobs, keys_array(seed), pos, (), LOG_PROBS).tokens


def sample_coupled_at(logprobs: mx.array, seed: int, positions: Sequence[int] | mx.array,
                      ids: mx.array) -> mx.array:
    """`sample_coupled` for rows over a part of the vocabulary: column j of `logprobs`
    (N, n) is token ids[j], every other token has probability 0. Returns token ids (N,)
    int32, the very tokens `sample_coupled` draws from the rows lifted to the whole
    vocabulary (-inf elsewhere), with noise for the n columns only."""
    if logprobs.ndim != 2 or ids.shape != (logprobs.shape[1],):
        raise ValueError(f"logprobs (N, n) and ids (n,) expected, got "
                         f"{tuple(logprobs.shape)} and {tuple(ids.shape)}")
    noise = gumbel_noise_at(seed, positions, ids)
    if noise.shape[0] != logprobs.shape[0]:
        raise ValueError(f"{noise.shape[0]} positions for {logprobs.shape[0]} rows")
    best = mx.argmax(logprobs.astype(mx.float32) + noise, axis=-1)
    return mx.take(ids, best).astype(mx.int32)


# --------------------------------------------------------------------------- rejection rule


def sample_categorical(probabilities: mx.array, key: mx.array) -> mx.array:
    """One token per row (int32, shape without the last axis) drawn from `probabilities`.

    Zero-probability entries are never drawn. For the rejection rule, where the randomness
    is an explicit `mx.random` key rather than the coupled noise.
    """
    return mx.random.categorical(mx.log(probabilities), axis=-1, key=key).astype(mx.int32)


def residual_distribution(p: mx.array, q: mx.array) -> mx.array:
    """Row-wise norm(max(0, p - q)): where to resample after rejecting a draft from q.

    A row where p <= q everywhere (p == q) has no residual mass; it falls back to p.
    """
    residual = mx.maximum(p - q, 0.0)
    mass = mx.sum(residual, axis=-1, keepdims=True)
    safe = mx.where(mass > 0, mass, 1.0)
    return mx.where(mass > 0, residual / safe, p)
