"""What training a drafter head adds to a process's resident memory, measured as the app
holds it.

The app trains on its engine thread, in the process that already holds the model, its
head and the chat's caches. So the figure that matters is the peak while a job runs over
the resident memory just before it, with the model loaded and a reply answered (issue 11
bounds it at 300 MB). Peak RSS of a `train-drafter` process alone mixes in the model's own
load; this loads the model, answers one reply through a `ChatSession` (with the head when
one is trained), resets the kernel's peak and then runs the job.

    python -m tools.train_memory --model demo --minutes 5

Linux only: it reads VmRSS and VmHWM from /proc/self/status and resets the peak through
/proc/self/clear_refs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
PROMPT = "Give me three tips for sleeping better."


@dataclass(frozen=True)
class MemoryReport:
    """Megabytes resident before the job and at its peak; the head's step at the job's end
    (a resumed head counts on from its checkpoint)."""

    before_mb: float
    peak_mb: float
    step: int

    @property
    def added_mb(self) -> float:
        return self.peak_mb - self.before_mb

    def line(self) -> str:
        return (f"training added {self.added_mb:.0f} MB: peak {self.peak_mb:.0f} MB resident "
                f"over {self.before_mb:.0f} MB before the job, which ended at step {self.step}")


def resident_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process, in MB."""
    found: dict[str, float] = {}
    for line in STATUS.read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) / 1024
    return found["VmRSS"], found["VmHWM"]


def reset_peak() -> None:
    """Start the kernel's peak (VmHWM) over from the current resident size."""
    CLEAR_REFS.write_text("5")


def measure(target, options, root: Path | None = None,
            during: Callable[[], None] | None = None) -> MemoryReport:
    """Answer one reply as the app would, then run the training job `options` on `target`
    (a `LoadedModel`) into `root` (the head folder by default); `during` runs after each of
    the job's reports (tests allocate there)."""
    from engine.decode import ChatSession, GenerateOptions
    from engine.drafters.head_io import head_for_drafter
    from engine.training.job import train_drafter

    head = head_for_drafter(target, "auto")  # as a chat with `auto` carries it
    session = ChatSession(target, head=head)
    drafter = "auto" if head is not None else "none"
    for _ in session.generate([{"role": "user", "content": PROMPT}],
                              GenerateOptions(max_tokens=64, drafter=drafter)):
        pass
    reset_peak()  # then read: the peak starts from the resident size at the reset
    before, _ = resident_mb()
    step = 0
    for progress in train_drafter(target, options, root=root):
        step = progress.step
        if during is not None:
            during()
    return MemoryReport(before, resident_mb()[1], step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.train_memory",
                                     description="what a drafter training job adds to the resident "
                                     "memory of a process holding the model and a chat")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--minutes", type=float, default=5.0)
    args = parser.parse_args(argv)
    if not CLEAR_REFS.exists():
        print("error: this measures through /proc/self (Linux only)", file=sys.stderr)
        return 1
    from engine.loading import load_model
    from engine.training.job import TrainOptions

    options = TrainOptions(minutes=args.minutes)  # checked before the model loads
    print(measure(load_model(args.model), options).line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
