"""`understudy doctor`: the report here (no Metal), the verdict store, and the rule that only
kernels that passed (and won) on this exact setup are used."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from engine import doctor
from engine.doctor import DoctorReport, KernelPlan, plan_from
from kernels import dispatch
from kernels.selftest import KernelVerdict

REPO = Path(__file__).resolve().parents[2]
no_metal = pytest.mark.skipif(mx.metal.is_available(), reason="this machine has Metal")


@no_metal
def test_doctor_command_reports_backend_blas_and_references(tmp_path: Path) -> None:
    env = {**os.environ, "UNDERSTUDY_DATA_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "app.cli", "doctor"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("backend: cpu") and f"MLX {mx.__version__}" in lines[0]
    assert lines[1].startswith("BLAS: ") and "GFLOP/s" in lines[1]
    speed = float(lines[1].split(": ")[-1].split(" GFLOP/s")[0])
    assert speed > 0
    at = next(i for i, line in enumerate(lines) if line.startswith("  weight layout: "))
    layout, probe = lines[at:at + 2]
    times = [float(ms) for ms in re.findall(r"([0-9.]+) ms (?:row|column)-major", probe)]
    assert probe.startswith("    probe: ") and len(times) == 2 and all(t > 0 for t in times)
    chosen = "row" if times[0] * 1.1 < times[1] else "column"  # engine.layout.MARGIN
    assert layout == f"  weight layout: {chosen}-major (measured)"
    assert lines[-1] == "kernels: no Metal: references in use"
    pinned = subprocess.run([sys.executable, "-m", "app.cli", "doctor"], cwd=REPO,
                            env={**env, "UNDERSTUDY_WEIGHT_LAYOUT": "row"},
                            capture_output=True, text=True, timeout=300)
    assert "  weight layout: row-major (pinned by UNDERSTUDY_WEIGHT_LAYOUT)" in pinned.stdout
    assert not (tmp_path / doctor.VERDICTS_FILE).exists()  # nothing judged, nothing stored


def test_cli_process_has_openblas_when_installed(tmp_path: Path) -> None:
    """The launcher preloads the system OpenBLAS and doctor says so (Linux with the package)."""
    if not Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0").exists():
        pytest.skip("system OpenBLAS (libopenblas0-pthread) not installed")
    lib = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "UNDERSTUDY_NO_REEXEC", "OPENBLAS_CORETYPE")}
    env["UNDERSTUDY_DATA_DIR"] = str(tmp_path)
    # what OpenBLAS would fall back to here, asked in a process of its own
    forced = subprocess.run([sys.executable, "-m", "engine.blas_core", lib], cwd=REPO,
                            env=env, capture_output=True, text=True, check=True).stdout.strip()
    proc = subprocess.run([sys.executable, "-m", "app.cli", "doctor"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "BLAS: OpenBLAS (preloaded): " in proc.stdout
    kernels = next(line for line in lines if line.startswith("  core type: "))
    if forced:  # the launcher chose the kernels, and doctor names them
        core = forced.split("=", 1)[1]
        assert kernels == f"  core type: {core} (OPENBLAS_CORETYPE={core})"
    else:
        assert kernels.endswith("(OpenBLAS's own choice)")
    threads = next(line for line in lines if line.startswith("  threads: "))
    assert re.fullmatch(r"  threads: [1-9][0-9]* \(fewer while other processes keep the "
                        r"cores busy\)", threads), threads


FAILED = KernelVerdict("verify_sampler", passed=False, reason="token differs (row 3)")
SLOWER = KernelVerdict("verify_sampler", passed=True, use=False)
FASTER = KernelVerdict("verify_sampler", passed=True, use=True, widths=[1, 5])
WINS = KernelVerdict("qmm", passed=True, use=True, widths=[2, 3, 4],
                     timings_ms={"builtin": {1: 0.1, 2: 0.2}, "kernel": {2: 0.12}},
                     notes=["8 rows cost 3.00x one row"])


def test_only_kernels_that_passed_and_won_are_planned() -> None:
    assert plan_from([FAILED, WINS]) == KernelPlan(sampler_widths=(), qmm_widths=(2, 3, 4))
    assert plan_from([SLOWER]) == KernelPlan()
    assert plan_from([FASTER]) == KernelPlan(sampler_widths=(1, 5))
    broken_qmm = KernelVerdict("qmm", passed=False, reason="x", use=True, widths=[2])
    assert plan_from([broken_qmm]) == KernelPlan()
    assert plan_from([]) == KernelPlan()  # never judged: references
    compaction = KernelVerdict("kv_compact", passed=True, use=True, widths=[2, 16])
    assert plan_from([compaction, SLOWER]) == KernelPlan(kv_compact_widths=(2, 16))
    assert plan_from([KernelVerdict("kv_compact", passed=False, use=True,
                                    widths=[2])]) == KernelPlan()


def test_kernels_added_since_the_last_run_are_judged() -> None:
    """A setup whose verdicts predate a kernel gets that kernel judged on the next run; the
    stored verdicts stand (no re-measuring); nothing stored means every kernel."""
    assert doctor.unjudged([FAILED, WINS]) == ["kv_compact"]
    assert doctor.unjudged([]) == ["verify_sampler", "qmm", "kv_compact"]
    judged = [FAILED, WINS, KernelVerdict("kv_compact", passed=True)]
    assert doctor.unjudged(judged) == []


def test_verdicts_round_trip_per_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path))
    assert doctor.saved_verdicts() == []
    doctor.save_verdicts([FAILED, WINS])
    assert doctor.saved_verdicts() == [FAILED, WINS]
    assert doctor.setup_key().endswith(f"mlx {mx.__version__}")
    # Another device or MLX version has its own entry; this setup's stays as it was.
    store = (tmp_path / doctor.VERDICTS_FILE)
    text = store.read_text().replace(f"mlx {mx.__version__}", "mlx 0.0.1")
    store.write_text(text)
    assert doctor.saved_verdicts() == []


def test_a_corrupt_store_means_nothing_judged(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path))
    (tmp_path / doctor.VERDICTS_FILE).write_text("{not json")
    assert doctor.saved_verdicts() == []
    wrong_shape = {doctor.setup_key(): {"verify_sampler": {"name": 1}}}  # no "passed"
    (tmp_path / doctor.VERDICTS_FILE).write_text(json.dumps(wrong_shape))
    assert doctor.saved_verdicts() == []


def test_a_failed_kernel_shows_its_reason_and_stays_off() -> None:
    report = DoctorReport("metal", "Apple M2", "0.32.4", None, [FAILED, WINS], from_store=True)
    text = "\n".join(report.lines())
    assert "verify_sampler: FAILED, never used on this setup: token differs (row 3)" in text
    assert "qmm: in use at widths 2, 3, 4" in text
    assert "8 rows cost 3.00x one row" in text
    assert "stated targets" in text and "--recheck" in text


@no_metal
def test_without_metal_the_dispatcher_ignores_any_plan() -> None:
    dispatch.configure(sampler_widths=[1, 5], qmm_widths=[2, 4, 8], kv_compact_widths=[3])
    try:
        assert dispatch.active() == {"verify_sampler_widths": [], "qmm_widths": [],
                                     "kv_compact_widths": []}
    finally:
        dispatch.configure()
