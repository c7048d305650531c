"""A finished command exits: no thread or exit handler may keep it alive (issue 16).

`understudy generate` used to print its answer and then sometimes never exit: the reply's
last step had queued a pass that nobody read, and when the process exited while that pass
was inside OpenBLAS on MLX's stream thread, OpenBLAS's exit handler (`gotoblas_quit`)
waited for ever on a pool thread that had missed its shutdown wake-up. Two layers guard
against it, and each has a test here:

* the engine leaves no MLX work in flight when a reply ends (`ChatSession._drive` waits for
  the last pass). A script that generates and then exits the ordinary way proves it; its
  model's last pass is made slow, so without the wait it is certain to be running when the
  exit handlers start. A negative control exits with such a pass in flight on purpose and
  must outlive the deadline — it shows this harness sees the hang at all.
* every command ends with a bounded exit once its output is written (`app.bounded_exit`):
  the CLI, run repeatedly from fresh app-data dirs (so calibration runs too), with and
  without a drafter, under a CPU load the test starts and stops, must be gone within
  DEADLINE_S of printing its stats line. The app's Quit joins the engine thread only so
  long (`EngineHost.shutdown` says when it did not stop, and the app then leaves anyway).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.cli.launcher import openblas_path
from tests.fixtures.tiny_models import write_tiny_model

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 10.0  # from a finished output to a gone process; a normal exit takes < 2 s
WORK_TIMEOUT_S = 120.0  # for the work itself, on a loaded machine
RUNS_PER_MODE = 3
MARK = "reply finished"

# Generates with a tiny model whose passes after the first two (prefill, first token) carry
# a heavy float32 matmul chain, so the pass queued by the last of two steps runs for seconds
# — then exits normally, through every exit handler. argv: model folder, "in-flight" to
# queue one such chain after the reply (the negative control: exiting with BLAS work in
# flight, which the engine no longer does).
_GENERATE_THEN_EXIT = f"""
import dataclasses, sys
import mlx.core as mx
from engine.decode import ChatSession, GenerateOptions
from engine.loading import load_model
from engine.sampling import SamplingParams

W = mx.random.normal((768, 768), key=mx.random.key(0)) / 768 ** 0.5

def heavy():
    h = W
    for _ in range(60):
        h = h @ W
    return h

class SlowLastPasses:
    def __init__(self, model):
        self._model, self._calls = model, 0
    def __call__(self, x, cache=None, **kwargs):
        self._calls += 1
        out = self._model(x, cache=cache, **kwargs)
        return out + 0.0 * heavy()[0, 0] if self._calls > 2 else out
    def __getattr__(self, name):
        return getattr(self._model, name)

target = load_model(sys.argv[1])
target = dataclasses.replace(target, model=SlowLastPasses(target.model))
options = GenerateOptions(max_tokens=2, sampling=SamplingParams(temperature=0.8, seed=3))
for _ in ChatSession(target).generate([{{"role": "user", "content": "Hi"}}], options):
    pass
if sys.argv[2:] == ["in-flight"]:
    mx.async_eval(heavy())
print("{MARK}", flush=True)
"""


@dataclass
class Run:
    """One process: when its output was complete and when it was gone (monotonic seconds)."""

    name: str
    proc: subprocess.Popen
    done_at: float | None = None
    gone_at: float | None = None
    stderr: str = ""

    @property
    def outlived_s(self) -> float | None:
        """Seconds it stayed alive after its output (None: never finished its output)."""
        if self.done_at is None:
            return None
        return (self.gone_at if self.gone_at is not None else time.monotonic()) - self.done_at


def _watch(run: Run, is_done, stream) -> None:
    """Read `stream` until `is_done(line)`, then give the process DEADLINE_S to exit."""
    for line in stream:
        run.stderr += line
        if is_done(line):
            run.done_at = time.monotonic()
            break
    if run.done_at is None:
        return  # the stream ended without it: the process failed (asserted by the caller)
    try:
        run.proc.wait(DEADLINE_S)
        run.gone_at = time.monotonic()
    except subprocess.TimeoutExpired:
        pass  # left alive for the assertion; killed by `_finish`


def _watch_all(runs: list[Run], is_done, stream_of) -> None:
    threads = [threading.Thread(target=_watch, args=(r, is_done, stream_of(r.proc)), daemon=True)
               for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WORK_TIMEOUT_S + DEADLINE_S)


def _finish(runs: list[Run]) -> None:
    for r in runs:
        if r.proc.poll() is None:
            r.proc.kill()
        r.proc.wait()


@pytest.fixture
def cpu_load() -> Iterator[None]:
    """A busy loop per core for the test's length: the hang was likelier on a busy machine."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for p in loops:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("exit") / "tiny")


def _child_env(data_dir: Path) -> dict[str, str]:
    env = {**os.environ, "UNDERSTUDY_DATA_DIR": str(data_dir)}
    lib = openblas_path()
    if lib is not None:  # the engine scripts get the BLAS the CLI would re-exec with
        env["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    return env


@pytest.mark.slow
def test_cli_exits_promptly_after_its_output(tiny: Path, tmp_path: Path, cpu_load: None) -> None:
    runs = []
    for mode in ("none", "ngram"):
        for i in range(RUNS_PER_MODE):
            data = tmp_path / f"{mode}-{i}"  # fresh: the ngram runs calibrate first
            argv = ["generate", "--model", str(tiny), "--drafter", mode, "--temperature",
                    "0.8", "--seed", str(i), "--max-tokens", "24", "--prompt", "Hello world!"]
            proc = subprocess.Popen([sys.executable, "-m", "app.cli", *argv], cwd=REPO,
                                    env={**os.environ, "UNDERSTUDY_DATA_DIR": str(data)},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True)
            runs.append(Run(f"{mode} #{i}", proc))
    try:
        _watch_all(runs, lambda line: line.startswith("[") and "tokens/pass" in line,
                   lambda p: p.stderr)
    finally:
        _finish(runs)
    for r in runs:
        assert r.done_at is not None, f"{r.name}: no stats line:\n{r.stderr}"
        assert r.gone_at is not None, (
            f"{r.name}: still running {DEADLINE_S:.0f} s after its output was complete")
        assert r.proc.returncode == 0, f"{r.name}: exit {r.proc.returncode}\n{r.stderr}"


def _generate_then_exit(tiny: Path, tmp_path: Path, *extra: str) -> Run:
    proc = subprocess.Popen([sys.executable, "-c", _GENERATE_THEN_EXIT, str(tiny), *extra],
                            cwd=REPO, env=_child_env(tmp_path / "data"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run = Run("generate-then-exit", proc)
    try:
        _watch_all([run], lambda line: line.strip() == MARK, lambda p: p.stdout)
    finally:
        _finish([run])
    assert run.done_at is not None, run.stderr
    return run


def _openblas_mapped(tmp_path: Path) -> bool:
    out = subprocess.run(
        [sys.executable, "-c", "import mlx.core; print(open('/proc/self/maps').read())"],
        env=_child_env(tmp_path), capture_output=True, text=True)
    return "libopenblas" in out.stdout


@pytest.mark.slow
def test_a_finished_reply_leaves_nothing_to_hold_up_the_exit(tiny: Path, tmp_path: Path,
                                                               cpu_load: None) -> None:
    run = _generate_then_exit(tiny, tmp_path)
    assert run.gone_at is not None, (
        f"still running {DEADLINE_S:.0f} s after the reply ended: the engine left MLX work "
        f"in flight at exit\n{run.stderr}")
    assert run.proc.returncode == 0, run.stderr


@pytest.mark.slow
@pytest.mark.xfail(reason="the hang it shows is a race: most runs hang, a quiet one may not", strict=False)
def test_negative_control_exiting_with_blas_work_in_flight_hangs(tiny: Path,
                                                                 tmp_path: Path) -> None:
    """What the engine used to do, done on purpose: the harness must see the hang."""
    if not _openblas_mapped(tmp_path):
        pytest.skip("no system OpenBLAS here: its exit-handler race cannot happen")
    run = _generate_then_exit(tiny, tmp_path, "in-flight")
    assert run.gone_at is None, (
        "exited although BLAS work was in flight: this harness no longer sees the "
        "OpenBLAS exit race, so the test above could not fail; revisit it")


def test_quit_waits_for_the_engine_thread_only_so_long(qtbot) -> None:
    """An engine thread stuck in a call (a load, a calibration) cannot hold up Quit."""
    from PySide6.QtCore import QTimer

    from app.ui.worker import EngineHost

    host = EngineHost()
    entered, release = threading.Event(), threading.Event()

    def stuck() -> None:  # runs on the engine thread, like a slot inside a long MLX call
        entered.set()
        release.wait(30)

    QTimer.singleShot(0, host.worker, stuck)
    assert entered.wait(10)
    try:
        t0 = time.monotonic()
        assert host.shutdown(timeout_ms=300) is False
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
    assert host.thread.wait(10_000)
    assert host.shutdown() is True  # a stopped thread: nothing to wait for
