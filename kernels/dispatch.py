"""The one door from the engine to the kernels: each call picks kernel or fallback.

Nothing runs a kernel until `configure` says the device passed its self-test
(`understudy doctor`, which stores verdicts per device and MLX version; the engine applies
them once when a model loads). The decision is made there, once: per call the dispatcher
only checks a module flag and the input's shape, so the CPU hot path pays one branch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import mlx.core as mx

from kernels import kv_compact, qmm, verify_sampler
from kernels.source import metal_available
from kernels.verify_sampler import SampledRows, SamplerSpec

_sampler_widths: frozenset[int] = frozenset()
_qmm_widths: frozenset[int] = frozenset()
_kv_compact_widths: frozenset[int] = frozenset()


def configure(sampler_widths: Iterable[int] = (), qmm_widths: Iterable[int] = (),
              kv_compact_widths: Iterable[int] = ()) -> None:
    """Allow the fused sampler, the small-batch matmul and the KV compaction at these row
    counts.

    Ignored (everything off) where Metal is unavailable, whatever the caller passes.
    """
    global _sampler_widths, _qmm_widths, _kv_compact_widths
    on_metal = metal_available()
    _sampler_widths = frozenset(int(w) for w in sampler_widths) if on_metal else frozenset()
    _qmm_widths = frozenset(int(w) for w in qmm_widths) if on_metal else frozenset()
    _kv_compact_widths = (frozenset(int(w) for w in kv_compact_widths) if on_metal
                          else frozenset())


def active() -> dict[str, object]:
    """What the dispatcher uses now (for `doctor` and the Diagnostics pane)."""
    return {"verify_sampler_widths": sorted(_sampler_widths), "qmm_widths": sorted(_qmm_widths),
            "kv_compact_widths": sorted(_kv_compact_widths)}


def sample_rows(scores: mx.array, keys: mx.array, positions: mx.array,
                draft: mx.array | Sequence[int], spec: SamplerSpec) -> SampledRows:
    """Coupled tokens, probabilities and the accepted prefix (`verify_sampler.reference`);
    the kernel at the row counts where it passed and won on this device."""
    use = bool(_sampler_widths) and scores.shape[0] in _sampler_widths
    return verify_sampler.sample(scores, keys, positions, draft, spec, use_kernel=use)


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                     group_size: int, bits: int) -> mx.array:
    """x @ dequantize(w).T (`qmm.reference`); the kernel only at widths that won there."""
    return qmm.matmul(x, w, scales, biases, group_size, bits, kernel_widths=_qmm_widths)


def gather_kv_rows(keys: mx.array, values: mx.array,
                   rows: Sequence[int]) -> tuple[mx.array, mx.array]:
    """keys[..., rows, :] and values[..., rows, :] (`kv_compact.reference`); the kernel, one
    dispatch for both, at the row counts where it passed and won on this device."""
    return kv_compact.gather(keys, values, rows, kernel_widths=_kv_compact_widths)
