"""Fused verify sampler: every verified row's coupled Gumbel-max token and the accepted prefix.

For (N, V) scores (N = K+1 verified rows, or any rows to sample) it returns each row's token
argmax(log p + g(seed, t, v)), that token's probability, the target probability of each
draft token, and how many drafts equal the row's own token up to the first miss. Stock MLX
does this with a dozen small ops per row and a host sync per read; the kernel does it in
two dispatches — partials across the vocabulary (one threadgroup per 2048-entry stretch of
a row, not one per row), then one threadgroup that merges them — and one small readback.

The noise is `kernels.noise` computed in integer arithmetic in the kernel, so its uniforms
are bit-exact with the reference's. The log-sum-exp is summed in another order, so a row
whose two best perturbed scores tie within float rounding may pick the other one; that is
measure-zero, and the device self-test counts it.

On MLX's CPU backend rows with noise are sampled in numpy (`host_reference`): ~0.3 ms a
49,152-token row instead of ~1.7, a 16-row verify pass's ~3.7 ms instead of ~27.

What the kernel covers (`covers`): float32/float16 scores, 1 <= N <= MAX_ROWS rows, V a
multiple of TILE. Anything else (bfloat16, wider verifies, odd vocabularies) goes to the
reference, never to a kernel that was not written for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from kernels.compile import compiled_on_main_thread
from kernels.noise import (
    columns,
    cpu_backend,
    gumbel_from_bits,
    hash_bits,
    host_gumbel,
    metal_constants,
    scratch,
)
from kernels.source import metal_available, metal_source

MAX_ROWS = 16
TILE = 128  # vocabulary entries per tile: one per thread of a tile-pass threadgroup
GROUP_TILES = 16  # tiles per threadgroup (2048 entries; a row's last group may hold fewer)
KERNEL_DTYPES = (mx.float32, mx.float16)


@dataclass(frozen=True)
class SamplerSpec:
    """What the sampler does to each row before the Gumbel-max.

    greedy: the row's argmax (probability 1), no noise. normalize: scores are unnormalized
    log-weights, multiplied by `inv_temperature` and log-softmaxed; otherwise they are
    log-probabilities already and used as they are.
    """

    greedy: bool = False
    normalize: bool = True
    inv_temperature: float = 1.0


LOG_PROBS = SamplerSpec(normalize=False)
"""Scores that are log-probabilities already (the engine's `sample_coupled`)."""


@dataclass(frozen=True)
class SampledRows:
    """Lazy results of one sampler call; read them with one `mx.eval`."""

    tokens: mx.array  # (N,) int32
    n_accepted: mx.array  # () int32: leading drafts equal to their row's token
    p_token: mx.array  # (N,) float32
    p_draft: mx.array  # (K,) float32


# --------------------------------------------------------------------------- reference


def log_softmax(scores: mx.array) -> mx.array:
    """Normalize scores to log-probabilities per row; -inf stays -inf."""
    return scores - mx.logsumexp(scores, axis=-1, keepdims=True)


def draft_probs(logp: mx.array, draft: mx.array) -> mx.array:
    """p_i(d_i) for each of the K drafts; 0 for ids outside the vocabulary (a draft model
    with a padded embedding can propose those; they are never gathered out of bounds)."""
    K = draft.shape[0]
    inside = draft < logp.shape[-1]
    safe = mx.where(inside, draft, 0)[:, None]
    return mx.where(inside, mx.exp(mx.take_along_axis(logp[:K], safe, axis=-1)[:, 0]), 0.0)


def accepted_prefix(draft: mx.array, tokens: mx.array) -> mx.array:
    """How many leading drafts equal their row's token: the count up to the first miss."""
    K = draft.shape[0]
    same = (draft == tokens[:K]).astype(mx.int32)
    return mx.sum(mx.cumprod(same)) if K else mx.array(0, dtype=mx.int32)


@lru_cache(maxsize=64)
def _reference_fn(spec: SamplerSpec):
    """One compiled function per spec (the temperature is baked in, like a processor's)."""

    def run(scores: mx.array, keys: mx.array, positions: mx.array, draft: mx.array,
            cols: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        if spec.greedy:
            tokens = mx.argmax(scores, axis=-1).astype(mx.int32)
            p_token = mx.ones(tokens.shape, dtype=mx.float32)
            inside = draft == tokens[: draft.shape[0]]
            p_draft = mx.where(inside, mx.array(1.0, mx.float32), mx.array(0.0, mx.float32))
        else:
            logp = log_softmax(scores * spec.inv_temperature) if spec.normalize else scores
            noise = gumbel_from_bits(hash_bits(keys, positions, cols.shape[0]))
            tokens = mx.argmax(logp + noise, axis=-1).astype(mx.int32)
            p_token = mx.exp(mx.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0])
            p_draft = draft_probs(logp, draft)
        return tokens, accepted_prefix(draft, tokens), p_token, p_draft

    return compiled_on_main_thread(run)


def reference(scores: mx.array, keys: mx.array, positions: mx.array, draft: mx.array,
              spec: SamplerSpec) -> SampledRows:
    """The sampler in plain MLX ops: what the engine's sampling and verify did before the
    kernel existed, op for op (so the engine's identity tests hold through it).

    Shapes:
        scores: (N, V) float32 (callers cast); keys: (2,) uint32 (`kernels.noise.keys_array`);
        positions: (N,) uint32; draft: (K,) int32 with K < N (K = 0: sampling only).
        Returns tokens (N,), n_accepted (), p_token (N,), p_draft (K,).
    """
    out = _reference_fn(spec)(scores, keys, positions, draft, columns(scores.shape[-1]))
    return SampledRows(*out)


def on_host(spec: SamplerSpec) -> bool:
    """Whether rows are sampled by `host_reference`: with noise, on MLX's CPU backend."""
    return not spec.greedy and cpu_backend()


def host_reference(scores: mx.array, keys: mx.array, positions: mx.array, draft: mx.array,
                   spec: SamplerSpec) -> SampledRows:
    """`reference` in numpy, for MLX's CPU backend, which takes `exp` and `log` one element
    at a time: a 49,152-token row at T > 0 took ~1.7 ms there, a 16-row verify pass's
    sampling ~27 ms, as much as a third of the pass; here ~0.3 and ~3.7. The same tokens
    but where a row's two best perturbed scores tie within float rounding (`host_gumbel`),
    the probabilities to float32 rounding (the log-sum-exp is summed in numpy's order).
    Its big arrays are `kernels.noise.scratch`'s. Same contract as `reference`; the
    results are evaluated already."""
    x = scratch("sampler.scores", scores.shape, np.float32)
    np.copyto(x, np.asarray(scores.astype(mx.float32)))
    if spec.normalize:
        x *= np.float32(spec.inv_temperature)
        top = x.max(axis=-1, keepdims=True)
        e = np.subtract(x, top, out=scratch("sampler.exp", x.shape, np.float32))
        np.exp(e, out=e)
        lse = top + np.log(e.sum(axis=-1, keepdims=True))
        x -= lse
    n_rows, vocab = x.shape
    key_a, key_b = (int(k) for k in np.asarray(keys))
    g = host_gumbel((key_a, key_b), np.asarray(positions), vocab)
    g += x
    tokens = np.argmax(g, axis=-1).astype(np.int32)
    p_token = np.exp(x[np.arange(n_rows), tokens])
    d = np.asarray(draft).astype(np.int64)
    inside = d < vocab
    p_draft = np.where(inside, np.exp(x[np.arange(d.shape[0]), np.where(inside, d, 0)]),
                       np.float32(0.0)).astype(np.float32)
    same = d == tokens[: d.shape[0]]
    n_accepted = int(np.argmin(same)) if not same.all() else int(d.shape[0])
    return SampledRows(mx.array(tokens), mx.array(n_accepted, dtype=mx.int32),
                       mx.array(p_token), mx.array(p_draft))


# --------------------------------------------------------------------------- kernel


def covers(scores: mx.array, n_draft: int) -> bool:
    """True when the kernel was written for these shapes and dtype (else: reference)."""
    if scores.ndim != 2 or scores.dtype not in KERNEL_DTYPES:
        return False
    n_rows, vocab = scores.shape
    return 1 <= n_rows <= MAX_ROWS and 0 <= n_draft < n_rows and vocab % TILE == 0


def _header() -> str:
    return metal_constants() + metal_source("verify_sampler_header")


@lru_cache(maxsize=1)
def make_kernels() -> tuple[object, object]:
    """The two `metal_kernel` objects (tile pass, reduce pass); constructible anywhere, but
    they only run on Metal. Each template variant is compiled by MLX on first use."""
    tiles = mx.fast.metal_kernel(
        name="understudy_verify_sampler_tiles",
        input_names=["scores", "positions", "keys", "inv_temperature"],
        output_names=["part_f", "part_i"],
        source=metal_source("verify_sampler_tiles"),
        header=_header(),
    )
    reduce = mx.fast.metal_kernel(
        name="understudy_verify_sampler_reduce",
        input_names=["scores", "draft", "inv_temperature", "part_f", "part_i"],
        output_names=["tokens", "n_accepted", "p_token", "p_draft"],
        source=metal_source("verify_sampler_reduce"),
        header=_header(),
    )
    return tiles, reduce


def build() -> tuple[object, object] | None:
    """The kernels, or None where Metal is unavailable."""
    return make_kernels() if metal_available() else None


def run_kernel(scores: mx.array, keys: mx.array, positions: mx.array, draft: mx.array,
               spec: SamplerSpec, verbose: bool = False) -> SampledRows:
    """The fused sampler on the GPU; same contract as `reference`. Only for shapes that
    `covers` accepts. `verbose` makes MLX print the complete generated source."""
    tiles, reduce = make_kernels()
    n_rows, vocab = scores.shape
    K = draft.shape[0]
    assert covers(scores, K)
    n_groups = -(-vocab // (TILE * GROUP_TILES))
    inv_t = mx.array([spec.inv_temperature if spec.normalize else 1.0], dtype=mx.float32)
    common = [("T", scores.dtype), ("V", vocab), ("N", n_rows), ("N_GROUPS", n_groups),
              ("GREEDY", spec.greedy), ("NORMALIZE", spec.normalize)]
    part_f, part_i = tiles(  # type: ignore[operator]
        inputs=[scores, positions, keys, inv_t],
        template=[*common, ("GROUP_TILES", GROUP_TILES), ("TG", TILE)],
        grid=(n_groups * TILE, n_rows, 1),
        threadgroup=(TILE, 1, 1),
        output_shapes=[(n_rows, n_groups, 3), (n_rows, n_groups)],
        output_dtypes=[mx.float32, mx.int32],
        verbose=verbose,
    )
    padded = mx.concatenate([draft.astype(mx.int32),
                             mx.full((n_rows - K,), -1, dtype=mx.int32)])
    tokens, n_acc, p_token, p_draft = reduce(  # type: ignore[operator]
        inputs=[scores, padded, inv_t, part_f, part_i],
        template=common,
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(n_rows,), (1,), (n_rows,), (n_rows,)],
        output_dtypes=[mx.int32, mx.int32, mx.float32, mx.float32],
        verbose=verbose,
    )
    return SampledRows(tokens, n_acc[0], p_token, p_draft[:K])


# --------------------------------------------------------------------------- dispatcher


def sample(scores: mx.array, keys: mx.array, positions: mx.array,
           draft: mx.array | Sequence[int], spec: SamplerSpec,
           use_kernel: bool = False) -> SampledRows:
    """The kernel where `use_kernel` (the device passed its self-test) and it covers the
    input; on the CPU backend, rows with noise on the host; the reference everywhere
    else."""
    if not isinstance(draft, mx.array):
        draft = mx.array(list(draft), dtype=mx.int32)
    if use_kernel and covers(scores, draft.shape[0]):
        return run_kernel(scores, keys, positions, draft, spec)
    if on_host(spec):
        return host_reference(scores, keys, positions, draft, spec)
    return reference(scores.astype(mx.float32), keys, positions, draft, spec)
