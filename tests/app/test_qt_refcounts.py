"""The Qt binding must keep Python's reference counts: the app emits a signal per target
pass and sets label text per step, for as long as a user chats.

PySide6 6.12.0 drops a reference to True on every signal emit and one to None on every
QLabel.setText. Before Python 3.12 those objects are not immortal, so after a few thousand
steps the process aborts ("bool_dealloc: deallocating True or False"). pyproject.toml
keeps that version out; this test catches any other that does the same.
"""

from __future__ import annotations

import sys

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QLabel

CALLS = 200  # enough to see a leak of one per call; far too few to crash the process


class _Emitter(QObject):
    step = Signal(int, object, object)
    flag = Signal(bool)


def _counts() -> tuple[int, int, int]:
    return sys.getrefcount(None), sys.getrefcount(True), sys.getrefcount(False)


def _drift(action) -> list[int]:
    action()  # warm-up: first calls may cache objects
    before = _counts()
    for _ in range(CALLS):
        action()
    return [after - b for after, b in zip(_counts(), before, strict=True)]


def test_signal_emits_and_label_updates_keep_refcounts(qapp) -> None:
    emitter = _Emitter()
    received = [0]  # counts only: keeping the arguments would hold references of its own

    def on_step(rid: int, step: object, stats: object) -> None:
        received[0] += 1

    def on_flag(flag: bool) -> None:
        received[0] += 1

    emitter.step.connect(on_step)
    emitter.flag.connect(on_flag)
    label = QLabel()

    drifts = {
        "emit(int, object, object)": _drift(lambda: emitter.step.emit(1, object(), None)),
        "emit(bool)": _drift(lambda: emitter.flag.emit(True)),
        "QLabel.setText": _drift(lambda: label.setText("12.3 tok/s")),
    }
    assert received[0] == 2 * (CALLS + 1)  # every emit reached its slot
    # a leak of one reference per call would show as -CALLS; allow small legitimate noise
    for what, drift in drifts.items():
        assert all(abs(d) < CALLS // 4 for d in drift), f"{what}: refcount drift {drift}"
