"""Which model the app opens on, what a model that fails to load leaves, damaged settings,
and the drafter list's `model` entry: real engine thread, store, widgets and settings files."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from PySide6.QtWidgets import QFileDialog

from app.store import COMPLETE
from app.ui.worker import ChatSettings

TIMEOUT = 60_000
REPO = Path(__file__).resolve().parents[2]


def plain_settings(target: Path, **kw) -> ChatSettings:
    return ChatSettings(target=str(target), drafter="off", max_tokens=kw.pop("max_tokens", 6),
                        **kw)


def choose_folder(monkeypatch, combo, folder: Path) -> None:
    """Pick "Choose a folder…" and answer the folder dialog with `folder`."""
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(folder))
    combo.setCurrentIndex(combo.findData("\x00choose-folder"))


def wait_idle(qtbot, gui) -> None:
    qtbot.waitUntil(lambda: not gui.controller.generating, timeout=TIMEOUT)


# -- a model that fails to load ----------------------------------------------------------------

def test_a_model_that_fails_to_load_leaves_the_one_in_use(qtbot, make_gui, tiny_pair, tmp_path,
                                                          monkeypatch, screenshots_dir) -> None:
    """A folder with a broken config.json said "Loading …" forever, left its name in Target
    and unloaded the model in use, so the next message failed without a reply."""
    target = tiny_pair[0]
    gui = make_gui(plain_settings(target))
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    panel, window = gui.window.settings_panel, gui.window
    bad = tmp_path / "badmodel"
    bad.mkdir()
    (bad / "config.json").write_text("{garbage")
    loaded: list[str] = []
    gui.controller.model_loaded.connect(lambda info: loaded.append(info.spec))

    choose_folder(monkeypatch, panel.target_combo, bad)
    qtbot.waitUntil(lambda: "Could not load model" in window.banner.text, timeout=TIMEOUT)
    assert "config.json" in window.banner.text
    assert window.banner.text.endswith("— still using tiny-target.")
    assert gui.controller.settings.target == str(target)
    assert panel.target_combo.currentData() == str(target)
    assert window.model_label.text() == "Could not load badmodel — still using tiny-target · " \
        f"{gui.controller.model.model_type} · {gui.controller.model.backend}"
    assert panel.model_status.text() == "Could not load badmodel; still using tiny-target"
    assert not window.load_progress.isVisible()
    assert loaded == []  # the model in use was never let go, so nothing loaded again
    window.grab().save(str(screenshots_dir / "model_load_failed.png"))

    gui.controller.send("Are you there?")
    wait_idle(qtbot, gui)
    [user, reply] = gui.store.messages(gui.controller.conversation_id)
    assert user.content == "Are you there?"
    assert reply.status == COMPLETE and reply.model == str(target)
    assert reply.stats["generated_tokens"] == 6


def test_a_model_that_fails_late_in_its_load_gives_way_to_the_one_before(
        qtbot, make_gui, tiny_pair, tmp_path) -> None:
    """A folder that looks whole but fails once loading has begun (here its tokenizer):
    the model in use was already let go, so it is loaded again and answers."""
    target = tiny_pair[0]
    gui = make_gui(plain_settings(target))
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    broken = tmp_path / "broken-tokenizer"
    shutil.copytree(target, broken)
    (broken / "tokenizer.json").write_text("{not a tokenizer")
    loaded: list[str] = []
    gui.controller.model_loaded.connect(lambda info: loaded.append(info.spec))

    gui.controller.set_settings(replace(gui.controller.settings, target=str(broken)))
    qtbot.waitUntil(lambda: loaded == [str(target)], timeout=TIMEOUT)
    assert "Could not load model" in gui.window.banner.text
    assert gui.controller.settings.target == str(target)
    assert gui.window.model_label.text().startswith("tiny-target · ")
    gui.controller.send("Still there?")
    wait_idle(qtbot, gui)
    assert gui.store.messages(gui.controller.conversation_id)[-1].status == COMPLETE
