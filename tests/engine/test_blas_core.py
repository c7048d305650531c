"""OpenBLAS's kernels: the fallback is replaced only by what the CPU supports, never a core
OpenBLAS recognised or one the user chose, and the kernels picked here compute correctly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli.launcher import openblas_path
from engine.blas_core import ENV, better_core, coretype_env, cpu_flags

REPO = Path(__file__).resolve().parents[2]
AVX512 = frozenset(["fpu", "sse2", "avx", "avx2", "fma", "avx512f", "avx512cd", "avx512bw",
                    "avx512dq", "avx512vl"])
AVX2 = frozenset(["fpu", "sse2", "avx", "avx2", "fma"])


def test_cpu_flags_reads_the_first_cpu(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\n"
                    "flags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "fma"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
    (tmp_path / "noflags").write_text("processor\t: 0\n")
    assert cpu_flags(tmp_path / "noflags") == frozenset()


@pytest.mark.parametrize(("reported", "flags", "core"), [
    ("Prescott", AVX512, "SkylakeX"),
    ("Prescott", AVX2, "Haswell"),
    ("Prescott", frozenset({"avx"}), "Sandybridge"),
    ("Prescott", frozenset({"sse2", "sse3"}), None),  # the fallback is all it can run
    ("Haswell", AVX512, None),  # OpenBLAS recognised the CPU: its choice stands
    ("Zen", AVX512, None),
    (None, AVX512, None),  # no OpenBLAS to ask
])
def test_only_the_fallback_is_replaced(reported: str | None, flags: frozenset[str],
                                       core: str | None) -> None:
    assert better_core(reported, flags) == core


def test_a_core_the_user_chose_stands(tmp_path: Path) -> None:
    assert coretype_env(tmp_path / "no-such-lib.so", {ENV: "Haswell"}) == {}
    assert coretype_env(tmp_path / "no-such-lib.so", {}) == {}  # nothing to ask


PRODUCTS = """
import json, sys
import numpy as np
import mlx.core as mx
from engine.blas_core import corename
rng = np.random.default_rng(0)
worst = 0.0
for m in (1, 2, 3, 5, 16, 17, 64, 255, 256):
    for k, n in ((576, 1536), (1536, 576), (67, 129)):
        x = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((n, k), dtype=np.float32)
        want = x.astype(np.float64) @ w.astype(np.float64).T
        for wm in (mx.array(w), mx.contiguous(mx.array(w).T).T):  # both weight layouts
            got = np.array(mx.array(x) @ wm.T)
            scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
            worst = max(worst, float(np.max(np.abs(got - want) / scale)))
# the negative control: float16 operands, an error the bound must catch
half = np.array((mx.array(x).astype(mx.float16) @ mx.array(w).astype(mx.float16).T)
                .astype(mx.float32))
control = float(np.max(np.abs(half - want) / scale))
print(json.dumps({"core": corename(), "worst": worst, "control": control}))
"""


@pytest.mark.skipif(openblas_path() is None, reason="no system OpenBLAS to preload")
def test_the_chosen_kernels_compute_mlx_products_correctly() -> None:
    """In a process set up as the launcher sets it up, OpenBLAS runs the kernels we chose
    and MLX's float32 products match float64 ones to float32 rounding (relative to the
    sum of magnitudes), at the widths decoding, verification and prefill use."""
    lib = openblas_path()
    assert lib is not None
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ENV)}
    chosen = subprocess.run([sys.executable, "-m", "engine.blas_core", str(lib)], env=env,
                            cwd=REPO, capture_output=True, text=True, check=True).stdout
    env.update(dict(kv.split("=", 1) for kv in chosen.split()))
    env["LD_PRELOAD"] = str(lib)
    out = subprocess.run([sys.executable, "-c", PRODUCTS], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    if ENV in env:
        assert result["core"] == env[ENV]
    assert result["core"] is not None
    assert result["worst"] < 1e-5 < result["control"], result
