"""Our cblas_sgemm for a decoding step's few rows (kernels/cpu/few_rows_sgemm.c,
engine/few_rows.py): built from source once, right against a float64 reference, a row of
a wide product equal to the one-row product bit for bit, and in front of OpenBLAS when
preloaded, as the launcher and `make test` preload it.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from app.cli.launcher import openblas_path
from engine import few_rows

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112

needs_kernel = pytest.mark.skipif(few_rows.unsupported() is not None or
                                  few_rows.compiler() is None,
                                  reason="the few-row kernel does not run on this machine")


@pytest.fixture(scope="module", params=["this CPU", "AVX2 only"])
def library(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The library as built for this CPU, and as built for one without AVX-512 (its
    narrower tiles), where this CPU can run both."""
    if few_rows.unsupported() is not None or few_rows.compiler() is None:
        pytest.skip("the few-row kernel does not run on this machine")
    flags = few_rows.compile_flags() if request.param == "this CPU" else few_rows.CFLAGS
    if request.param != "this CPU" and flags == few_rows.compile_flags():
        pytest.skip("this CPU's build is the AVX2 one")
    built = few_rows.build(few_rows.library_path(tmp_path_factory.mktemp("native"), flags),
                           flags)
    assert built is not None and built.exists()
    return built


def test_wide_tiles_where_the_cpu_has_avx512vl() -> None:
    assert few_rows.compile_flags(frozenset({"avx2", "fma"})) == few_rows.CFLAGS
    wide = few_rows.compile_flags(frozenset({"avx2", "fma", "avx512f", "avx512vl"}))
    assert wide == (*few_rows.CFLAGS, "-mavx512vl")
    assert few_rows.library_path(Path("/x"), wide) != few_rows.library_path(Path("/x"),
                                                                            few_rows.CFLAGS)


def sgemm(lib: ctypes.CDLL, a: np.ndarray, b: np.ndarray, alpha: float = 1.0,
          beta: float = 0.0, c: np.ndarray | None = None) -> np.ndarray:
    """Row-major a @ b.T through the library's cblas_sgemm (a, b may be row slices of
    wider arrays: their leading dimension is their row stride)."""
    M, K = a.shape
    N = b.shape[0]
    out = np.zeros((M, N), np.float32) if c is None else c
    f = lib.cblas_sgemm
    f.restype = None
    ptr = ctypes.POINTER(ctypes.c_float)
    f(ROW_MAJOR, NO_TRANS, TRANS, M, N, K, ctypes.c_float(alpha),
      a.ctypes.data_as(ptr), a.strides[0] // 4, b.ctypes.data_as(ptr), b.strides[0] // 4,
      ctypes.c_float(beta), out.ctypes.data_as(ptr), out.strides[0] // 4)
    return out


@needs_kernel
@pytest.mark.parametrize(("M", "N", "K"), [(1, 1536, 576), (2, 577, 576), (3, 64, 1536),
                                           (4, 1000, 576), (5, 33, 200), (8, 96, 64),
                                           (13, 130, 77), (33, 1536, 576), (64, 40, 3)])
def test_products_match_a_float64_reference(library: Path, M: int, N: int, K: int) -> None:
    lib = ctypes.CDLL(str(library))
    rng = np.random.default_rng(M * 1000 + N)
    a, b = rng.standard_normal((M, K), np.float32), rng.standard_normal((N, K), np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64).T
    got = sgemm(lib, a, b)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max() + 1e-5
    # alpha and beta as BLAS defines them, on a C that holds values
    c = rng.standard_normal((M, N), np.float32)
    got = sgemm(lib, a, b, alpha=0.5, beta=-2.0, c=c.copy())
    assert np.allclose(got, 0.5 * want - 2.0 * c, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_a_row_of_a_wide_product_equals_the_one_row_product_exactly(library: Path) -> None:
    """The verify pass's row and the one-token step's must agree to the bit: the tile a row
    falls in (1-2 rows streamed, groups of rows in tiles of every shape, a remainder of B's
    rows) must not change its arithmetic: every M up to the library's 64. Strided operands
    (rows of a wider array) as MLX passes them."""
    lib = ctypes.CDLL(str(library))
    rng = np.random.default_rng(0)
    wide_a = rng.standard_normal((64, 1600), np.float32)
    b = rng.standard_normal((143, 1600), np.float32)[:, :1541]  # K with a tail, strided
    for K in (576, 1541):
        alone = [sgemm(lib, wide_a[i : i + 1, :K], b[:, :K]) for i in range(64)]
        for M in range(1, 65):
            got = sgemm(lib, wide_a[:M, :K], b[:, :K])
            for i in range(M):
                assert np.array_equal(got[i], alone[i][0]), (K, M, i)


@needs_kernel
def test_the_library_is_built_once_and_named_by_its_source(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    path = few_rows.library_path(tmp_path)
    assert path.name.startswith("libunderstudyblas-") and path.suffix == ".so"
    built = few_rows.build(path)
    assert built == path
    stamp = path.stat().st_mtime_ns
    monkeypatch.setenv("CC", "/bin/false")  # a second build would fail: none runs
    assert few_rows.build(path) == path and path.stat().st_mtime_ns == stamp
    # another source, another library
    other = tmp_path / "other.c"
    other.write_text(few_rows.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(few_rows, "SOURCE", other)
    assert few_rows.library_path(tmp_path) != path


@needs_kernel
def test_a_compiler_without_avx512vl_still_builds_the_avx2_tiles(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with AVX-512VL whose compiler cannot target it, the library is the AVX2
    build, not OpenBLAS alone."""
    real = few_rows.compiler()
    assert real is not None
    cc = tmp_path / "cc-without-avx512"
    cc.write_text("#!/bin/sh\n"
                  'for a in "$@"; do [ "$a" = -mavx512vl ] && '
                  '{ echo "unrecognized option -mavx512vl" >&2; exit 1; }; done\n'
                  f'exec {real} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(few_rows, "cpu_flags",
                        lambda: frozenset({"avx2", "fma", "avx512f", "avx512vl"}))
    assert few_rows.compile_flags() != few_rows.CFLAGS
    built = few_rows.preload()
    assert built == few_rows.library_path(flags=few_rows.CFLAGS) and built.exists()
    assert few_rows.library_path().with_suffix(".failed").exists()  # the wide one, once
    assert few_rows.preload() == built  # and the next start goes straight to it


def test_a_failed_build_leaves_nothing_and_says_why(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C;\n")
    monkeypatch.setattr(few_rows, "SOURCE", bad)
    monkeypatch.setenv("CC", "gcc" if few_rows.compiler() in (None, "/bin/false") else
                       few_rows.compiler())
    dest = few_rows.library_path(tmp_path / "native")
    with caplog.at_level("WARNING"):
        assert few_rows.build(dest) is None
    assert not dest.exists() and not list(dest.parent.glob(".*tmp"))
    assert "could not build" in caplog.text
    failed = dest.with_suffix(".failed")
    assert "bad.c" in failed.read_text()
    # not tried again at the next start: no second warning, and no compiler run
    caplog.clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level("WARNING"):
        assert few_rows.build(dest) is None
    assert caplog.text == ""
    failed.unlink()
    with caplog.at_level("WARNING"):
        assert few_rows.build(dest) is None  # a compiler that is not there
    assert "failed" in caplog.text


def test_where_it_does_not_apply_it_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    assert few_rows.unsupported(frozenset({"sse2", "avx"})) in (
        "the CPU lacks avx2, fma", "only built for Linux on x86-64")
    monkeypatch.setenv(few_rows.ENV, "0")
    assert few_rows.unsupported() == f"turned off ({few_rows.ENV}=0)"
    assert few_rows.preload() is None
    out = subprocess.run([sys.executable, "-m", "engine.few_rows", "/x/libopenblas.so.0"],
                         capture_output=True, text=True, env={**os.environ,
                                                              few_rows.ENV: "0"})
    assert out.returncode == 0 and out.stdout.strip() == "LD_PRELOAD=/x/libopenblas.so.0"


@needs_kernel
def test_preloaded_ahead_of_openblas_it_serves_mlx(library: Path) -> None:
    """In a process started as the launcher starts one, MLX's few-row products come out
    of our library (bit-equal rows across widths, the library mapped in), and the wide
    ones still from OpenBLAS (right, and the process did not crash on them)."""
    blas = openblas_path()
    if blas is None:
        pytest.skip("no system OpenBLAS")
    script = textwrap.dedent("""
        import mlx.core as mx, numpy as np
        w = mx.random.normal((1536, 576), key=mx.random.key(1))
        x = mx.random.normal((300, 576), key=mx.random.key(2))
        rows = [np.array(x[i:i + 1] @ w.T)[0] for i in range(16)]
        wide = np.array(x[:16] @ w.T)
        print("equal", all(np.array_equal(wide[i], rows[i]) for i in range(16)))
        big = np.array(x @ w.T)
        ref = np.array(x).astype(np.float64) @ np.array(w).astype(np.float64).T
        print("prefill_err", float(np.abs(big - ref).max()))
        maps = open("/proc/self/maps").read()
        print("mapped", "libunderstudyblas" in maps)
    """)
    env = {**os.environ, "LD_PRELOAD": f"{library}:{blas}"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["equal"] == "True"
    assert lines["mapped"] == "True"
    assert float(lines["prefill_err"]) < 1e-3


POOL_SCRIPT = """
import ctypes, os, sys
import numpy as np
blas = ctypes.CDLL(sys.argv[2], mode=ctypes.RTLD_GLOBAL)
blas.openblas_set_num_threads.argtypes = [ctypes.c_int]
lib = ctypes.CDLL(sys.argv[1])
ptr = ctypes.POINTER(ctypes.c_float)
def product(a, b):
    M, K = a.shape
    N = b.shape[0]
    c = np.zeros((M, N), np.float32)
    lib.cblas_sgemm(101, 111, 112, M, N, K, ctypes.c_float(1.0), a.ctypes.data_as(ptr), K,
                    b.ctypes.data_as(ptr), K, ctypes.c_float(0.0), c.ctypes.data_as(ptr), N)
    return c
rng = np.random.default_rng(0)
a = rng.random((5, 576), np.float32)
b = rng.random((1536, 576), np.float32)
want = a.astype(np.float64) @ b.astype(np.float64).T
for t in (4, 2, 1, 3, 2):  # the pool grows to 3 helpers, then runs with fewer parts
    blas.openblas_set_num_threads(t)
    assert np.abs(product(a, b) - want).max() < 1e-3, t
pid = os.fork()
if pid == 0:  # the child has no helpers: it must start its own, not wait for the parent's
    ok = np.abs(product(a, b) - want).max() < 1e-3
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
print("ok" if status == 0 else f"child failed {status}")
"""


@needs_kernel
def test_the_helper_threads_follow_the_thread_count_and_survive_a_fork(library: Path,
                                                                      tmp_path: Path) -> None:
    """OpenBLAS's thread count (which `engine.blas_threads` moves with the machine's load)
    sets how many helpers share a product: grown to 3 helpers, then run with fewer, then
    forked, every product must finish (the first version waited for ever on a helper that
    had no part) and be right."""
    blas = openblas_path()
    if blas is None:
        pytest.skip("no system OpenBLAS")
    script = tmp_path / "pool.py"
    script.write_text(POOL_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(library), str(blas)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_doctor_says_who_serves_products_and_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import doctor
    from kernels import host_attention

    monkeypatch.setattr(host_attention, "kernel", lambda: object())
    said = doctor._few_rows_said(["/c/native/libunderstudyblas-abc.so"])
    assert said == ("products of 1-64 rows: Understudy's own (/c/native/libunderstudyblas-abc.so)",
                    "attention of inference passes: Understudy's own (the same library)")
    # a library this source built says which tiles it has
    for flags, tiles in ((few_rows.CFLAGS, "AVX2"), ((*few_rows.CFLAGS, "-mavx512vl"),
                                                     "AVX-512VL")):
        lib = str(few_rows.library_path(Path("/c/native"), flags))
        assert doctor._few_rows_said([lib])[0] == \
            f"products of 1-64 rows: Understudy's own ({tiles} tiles, {lib})"
    monkeypatch.setattr(host_attention, "kernel", lambda: None)
    assert doctor._few_rows_said(["/c/native/libunderstudyblas-abc.so"])[1] == \
        "attention of inference passes: MLX's ops (the library lacks it)"
    assert doctor._few_rows_said([])[1] == \
        "attention of inference passes: MLX's ops (the library is not loaded)"
