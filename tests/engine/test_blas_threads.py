"""OpenBLAS's thread count following the other processes' CPU use (engine/blas_threads.py):
the arithmetic, /proc/stat as Linux writes it, real spinning processes, the real library,
and replies that stay the same while the count changes under them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import blas_threads
from engine.blas_core import threads_api
from engine.blas_threads import (
    BlasThreads,
    Sample,
    others_busy,
    read_sample,
    wanted_threads,
)
from engine.decode import ChatSession, GenerateOptions
from engine.events import Finished
from engine.loading import load_model
from engine.sampling import SamplingParams
from tests.fixtures.tiny_models import write_tiny_model

STAT = """cpu  300 0 100 1000 50 0 0 0 0 0
cpu0 100 0 50 500 25 0 0 0 0 0
cpu1 200 0 50 500 25 0 0 0 0 0
intr 12345
"""


def test_the_others_cores_are_what_the_machine_used_less_this_process() -> None:
    before = Sample(wall=10.0, busy_s=100.0, own_s=5.0)
    after = Sample(wall=12.0, busy_s=104.0, own_s=6.0)
    assert others_busy(before, after) == pytest.approx(1.5)  # (4 - 1) / 2 s
    assert others_busy(before, Sample(12.0, 101.0, 7.0)) == 0.0  # never negative
    assert others_busy(before, before) == 0.0
    # a core counts as taken from 0.7 busy on; never fewer than one thread
    assert [wanted_threads(2, o) for o in (0.0, 0.5, 0.69, 0.71, 1.5, 1.8, 2.0)] == \
        [2, 2, 2, 1, 1, 1, 1]
    assert wanted_threads(8, 2.9) == 5 and wanted_threads(1, 0.0) == 1


def test_proc_stat_counts_only_the_cpus_this_process_may_use(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    both, one = read_sample(stat, frozenset({0, 1})), read_sample(stat, frozenset({1}))
    assert both is not None and one is not None
    assert both.busy_s * blas_threads.CLOCK_TICKS == pytest.approx(400)  # 150 + 250
    assert one.busy_s * blas_threads.CLOCK_TICKS == pytest.approx(250)
    assert read_sample(stat, frozenset({7})) is None  # none of ours listed
    stat.write_text("cpu0 x y z\n")
    assert read_sample(stat, frozenset({0})) is None
    assert read_sample(tmp_path / "missing") is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="Linux only")
def test_spinning_processes_take_the_cores_they_keep_busy() -> None:
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: nothing to give up")
    quiet_before = read_sample()
    time.sleep(1.0)
    quiet = others_busy(quiet_before, read_sample())  # the control: nobody spinning
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(cores)]
    try:
        time.sleep(0.3)
        before = read_sample()
        time.sleep(1.0)
        busy = others_busy(before, read_sample())
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert wanted_threads(cores, quiet) == cores, quiet
    assert busy > cores - 0.5 and wanted_threads(cores, busy) == 1, busy


def test_the_count_reaches_the_real_library_and_a_users_setting_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    api = threads_api()
    if api is None:
        pytest.skip("no OpenBLAS in this process")
    get, _ = api
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    threads = BlasThreads()
    start = get()
    try:
        threads.set(1)
        assert get() == 1 and threads.threads == 1
    finally:
        threads.set(start)
    assert get() == start
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert not BlasThreads().enabled  # the user chose: nothing adapts


class Flipping(BlasThreads):
    """Changes the count at every step, as a busy machine coming and going would."""

    def tick(self) -> int:
        self.set(1 if self.threads != 1 else max(2, self.cores))
        self.flips = getattr(self, "flips", 0) + 1
        return self.threads


def test_a_reply_is_the_same_when_the_count_changes_between_its_passes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if threads_api() is None:
        pytest.skip("no OpenBLAS in this process")
    model = load_model(write_tiny_model(tmp_path / "tiny"))
    messages = [{"role": "user", "content": "the cat sat on the mat"}]

    def reply(drafter: str) -> str:
        options = GenerateOptions(max_tokens=24, drafter=drafter, k=3,
                                  sampling=SamplingParams(temperature=0.8, seed=3))
        events = list(ChatSession(model).generate(messages, options))
        assert isinstance(events[-1], Finished)
        return events[-1].text

    steady = reply("none")
    flipping = Flipping()
    monkeypatch.setattr(blas_threads, "_shared", flipping)
    try:
        assert reply("none") == steady
        assert reply("ngram") == steady
    finally:
        flipping.set(flipping.cores)
    assert flipping.flips > 20  # it really changed under every pass


def test_loading_a_model_starts_the_first_window(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short prompt right after loading must not be read before any window has closed
    (on a busy machine it would run with every thread)."""
    if threads_api() is None:
        pytest.skip("no OpenBLAS in this process")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    earlier = blas_threads._shared
    if earlier is not None and earlier.enabled:
        earlier.set(earlier.cores)  # on a busy machine it may have taken threads away
    monkeypatch.setattr(blas_threads, "_shared", None)
    started = time.monotonic()
    load_model(write_tiny_model(tmp_path / "tiny"))
    watcher = blas_threads._shared
    assert watcher is not None and watcher.enabled
    assert started <= watcher._last.wall <= time.monotonic()
