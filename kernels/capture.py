"""Print the complete Metal source MLX builds for every kernel variant, without Metal.

MLX assembles each kernel's source (header, signature from the input/output names and the
built-ins the body uses, template instantiation) when the call is traced. Tracing it under
`mx.export_function` with `verbose=True` prints that source even on a CPU-only build,
where the kernel could never run. `python -m kernels.capture` prints every variant the
dispatchers can launch; tests/kernels/test_metal_source.py then checks each with clang.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from itertools import product

import mlx.core as mx

from kernels import kv_compact, qmm, verify_sampler
from kernels.noise import keys_array, positions_u32
from kernels.verify_sampler import SamplerSpec

BLOCK = re.compile(r"Generated source code for `(?P<name>[^`]+)`:\n```\n(?P<src>.*?)\n```",
                   re.DOTALL)


def trace(fn: Callable[..., object], *args: mx.array) -> None:
    """Trace `fn(*args)` without evaluating it; kernels called with verbose=True print."""
    mx.export_function(lambda *_: None, fn, *args)


def split_sources(text: str) -> dict[str, str]:
    """Printed blocks keyed by kernel function name (one per template variant)."""
    out: dict[str, str] = {}
    for block in BLOCK.finditer(text):
        src = block.group("src")
        found = re.search(r"\[\[kernel\]\] void (\w+)\(", src)
        out[found.group(1) if found else block.group("name")] = src
    return out


def sampler_variants() -> Iterator[tuple[mx.Dtype, SamplerSpec]]:
    """Every (dtype, kind of spec) the sampler dispatcher can launch (sizes aside)."""
    specs = (SamplerSpec(greedy=True), SamplerSpec(inv_temperature=1.25),
             SamplerSpec(normalize=False))
    yield from product(verify_sampler.KERNEL_DTYPES, specs)


def qmm_variants() -> Iterator[tuple[mx.Dtype, int, int, int]]:
    """Every (dtype, bits, group size, rows) the matmul dispatcher can launch."""
    rows = range(2, qmm.MAX_ROWS + 1)
    yield from product(qmm.KERNEL_DTYPES, qmm.BITS, qmm.GROUP_SIZES, rows)


def kv_compact_variants() -> Iterator[tuple[mx.Dtype, int, int]]:
    """Every (dtype, head dim, kept rows) kind the compaction dispatcher can launch: MLX
    passes fewer than 8 rows in constant memory and more in device memory, so one count of
    each."""
    yield from product(kv_compact.KERNEL_DTYPES, kv_compact.HEAD_DIMS, (2, kv_compact.MAX_ROWS))


def trace_all() -> int:
    """Trace every variant once (sources go to stdout); returns how many were traced."""
    count = 0
    # One full group of tiles and one partial group per row.
    vocab = verify_sampler.TILE * (verify_sampler.GROUP_TILES + 1)
    for dtype, spec in sampler_variants():
        n_rows = 5
        scores = mx.zeros((n_rows, vocab), dtype=dtype)
        positions = positions_u32(range(n_rows))
        draft = mx.zeros((n_rows - 1,), dtype=mx.int32)

        def sample(s: mx.array, k: mx.array, p: mx.array, d: mx.array,
                   spec: SamplerSpec = spec) -> mx.array:
            return verify_sampler.run_kernel(s, k, p, d, spec, verbose=True).tokens

        trace(sample, scores, keys_array(0), positions, draft)
        count += 2  # the tile pass and the reduce pass
    for dtype, bits, group_size, rows in qmm_variants():
        k, n = 2 * group_size, 16
        w, scales, biases = mx.quantize(mx.zeros((n, k)), group_size=group_size, bits=bits)
        x = mx.zeros((rows, k), dtype=dtype)

        def matmul(x: mx.array, w: mx.array, s: mx.array, b: mx.array,
                   group_size: int = group_size, bits: int = bits) -> mx.array:
            return qmm.run_kernel(x, w, s, b, group_size, bits, verbose=True)

        trace(matmul, x, w, scales.astype(dtype), biases.astype(dtype))
        count += 1
    for dtype, head_dim, n_rows in kv_compact_variants():
        cache = mx.zeros((1, 2, 32, head_dim), dtype=dtype)

        def gather(k: mx.array, v: mx.array, rows: mx.array) -> list[mx.array]:
            return list(kv_compact.run_kernel(k, v, rows, verbose=True))

        trace(gather, cache, cache, mx.arange(n_rows, dtype=mx.int32))
        count += 1
    return count


if __name__ == "__main__":
    print(f"traced {trace_all()} kernel variants", flush=True)
