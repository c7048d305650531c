"""Every kernel variant's complete Metal source passes clang's syntax check.

MLX prints the source it would compile for each variant (`python -m kernels.capture`,
tracing under `mx.export_function`, no Metal needed). clang++ checks every variant (one
translation unit per kernel: its header once, then each variant's function and
instantiation) as C++17 against
metal_shim.h, a small stand-in for Metal's address spaces, types and built-ins. The one
transformation: the attribute lists on the closing explicit instantiation line
(`template [[host_name(..)]] [[kernel]] decltype(..) name<..>;`) are dropped, because
C++ does not allow attributes there and Metal does. Negative controls: kernels with an
undeclared name, with a device pointer assigned to a thread pointer, and writing into an
input (MLX passes inputs as const), must fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernels.capture import kv_compact_variants, qmm_variants, sampler_variants, split_sources

CLANG = shutil.which("clang++")
SHIM = Path(__file__).with_name("metal_shim.h")
FLAGS = ["--target=aarch64-linux-gnu", "-std=c++17", "-ffreestanding", "-nostdinc++",
         "-fsyntax-only", "-Wno-unknown-attributes", "-include", str(SHIM), "-x", "c++"]
ROOT = Path(__file__).resolve().parents[2]

needs_clang = pytest.mark.skipif(
    CLANG is None, reason="clang++ not installed (apt package `clang`; CI installs it)")

BROKEN = {
    "undeclared name": ("out[thread_position_in_grid.x] = inp[thread_position_in_grid.x]"
                        " * not_declared_anywhere;", "undeclared identifier"),
    "device pointer into a thread pointer": (
        "thread float* p = out; p[thread_position_in_grid.x] = inp[0];",
        "cannot initialize a variable"),
    # MLX passes inputs as const: a kernel cannot compact a cache in place by writing to it.
    "write into an input": ("inp[thread_position_in_grid.x] = out[0];",
                            "read-only variable is not assignable"),
}
CONTROL = "out[thread_position_in_grid.x] = metal::exp(inp[thread_position_in_grid.x]);"

_BROKEN_SCRIPT = """
import sys
import mlx.core as mx
from kernels.capture import trace
kernel = mx.fast.metal_kernel(name=sys.argv[1], input_names=["inp"], output_names=["out"],
                              source=sys.argv[2])
def run(a):
    return kernel(inputs=[a], template=[("T", mx.float32)], grid=(a.size, 1, 1),
                  threadgroup=(32, 1, 1), output_shapes=[a.shape], output_dtypes=[a.dtype],
                  verbose=True)[0]
trace(run, mx.zeros((64,)))
"""


def captured(*args: str) -> dict[str, str]:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=True)
    return split_sources(proc.stdout)


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    return captured("-m", "kernels.capture")


def as_cxx(source: str) -> str:
    """Drop the attribute lists C++ rejects on the explicit instantiation line."""
    return re.sub(r"^template (\[\[[^\]]*\]\] )+", "template ", source, flags=re.MULTILINE)


def translation_units(sources: dict[str, str]) -> dict[str, str]:
    """Variants grouped by kernel: one header, then every variant's templated function and
    its instantiation (names differ per variant), so one clang run checks them all."""
    units: dict[str, list[str]] = {}
    for name, source in sources.items():
        header, _, rest = source.partition("template <typename")
        kernel = re.sub(r"^custom_kernel_|__.*$", "", name)
        units.setdefault(kernel, [header]).append("template <typename" + rest)
    return {kernel: "\n".join(parts) for kernel, parts in units.items()}


def clang_check(source: str, tmp: Path, name: str) -> subprocess.CompletedProcess[str]:
    path = tmp / f"{name}.metal"
    path.write_text(as_cxx(source), encoding="utf-8")
    return subprocess.run([CLANG, *FLAGS, str(path)], capture_output=True, text=True,
                          timeout=120)


def test_every_variant_is_captured(sources: dict[str, str]) -> None:
    n_sampler = 2 * len(list(sampler_variants()))  # tile and reduce pass per variant
    n_qmm = len(list(qmm_variants()))
    n_kv = len(list(kv_compact_variants()))
    names = list(sources)
    assert len(names) == n_sampler + n_qmm + n_kv
    assert sum("verify_sampler_tiles" in n for n in names) == n_sampler // 2
    assert sum("qmm_small" in n for n in names) == n_qmm
    assert sum("kv_compact" in n for n in names) == n_kv
    assert all("template <typename T" in src for src in sources.values())


@needs_clang
def test_every_variant_passes_clang(sources: dict[str, str], tmp_path: Path) -> None:
    units = translation_units(sources)
    assert len(units) == 4  # the sampler's two passes, the matmul and the KV compaction
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        procs = dict(zip(units, pool.map(lambda item: clang_check(item[1], tmp_path, item[0]),
                                         units.items()), strict=True))
    failures = {name: p.stderr[:4000] for name, p in procs.items() if p.returncode != 0}
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())


@needs_clang
@pytest.mark.parametrize("why", sorted(BROKEN))
def test_a_broken_kernel_fails_the_check(why: str, tmp_path: Path) -> None:
    body, message = BROKEN[why]
    (source,) = captured("-c", _BROKEN_SCRIPT, "broken", body).values()
    proc = clang_check(source, tmp_path, "broken")
    assert proc.returncode != 0, why
    assert message in proc.stderr, proc.stderr


@needs_clang
def test_the_same_kernel_unbroken_passes(tmp_path: Path) -> None:
    """Control for the negative tests: the harness itself accepts a correct kernel."""
    (source,) = captured("-c", _BROKEN_SCRIPT, "control", CONTROL).values()
    proc = clang_check(source, tmp_path, "control")
    assert proc.returncode == 0, proc.stderr
