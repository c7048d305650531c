"""The training-memory measurement (tools/train_memory.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.loading import load_model
from engine.training.fit import FitOptions
from engine.training.job import TrainOptions
from tests.fixtures.tiny_models import write_tiny_model
from tools.train_memory import CLEAR_REFS, measure

ALLOCATED_MB = 96


@pytest.mark.skipif(not CLEAR_REFS.exists(), reason="measures through /proc/self (Linux)")
def test_what_a_job_adds_is_measured_over_the_process_before_it(tmp_path: Path) -> None:
    """A job on a tiny model adds a little; the same job holding 96 MB more while it runs
    must show at least that much more (the control that the peak is the job's own, reset
    after the model and the reply)."""
    target = load_model(str(write_tiny_model(tmp_path / "t", num_hidden_layers=4, seed=1)))
    options = TrainOptions(minutes=5, rounds=1, gen_batch=8, max_new=24, max_steps=6,
                           checkpoint_every=1000, data_share=0.0,
                           fit=FitOptions(batch_size=4, window=64))
    plain = measure(target, options, root=tmp_path / "a")
    held: list[np.ndarray] = []

    def hold() -> None:
        if not held:
            held.append(np.ones(ALLOCATED_MB << 18, dtype=np.float32))  # touched: resident

    grown = measure(target, options, root=tmp_path / "b", during=hold)
    assert plain.step == grown.step == 6
    # the kernel batches its resident counters per thread: a peak may read a page or two
    # under the size read after the reset
    assert plain.before_mb > 50 and plain.peak_mb >= plain.before_mb - 1
    assert plain.added_mb < ALLOCATED_MB / 2
    assert grown.added_mb >= ALLOCATED_MB
    assert f"training added {plain.added_mb:.0f} MB" in plain.line()
