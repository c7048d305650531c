"""Which model the app opens on, what a model that fails to load leaves, damaged settings,
and the drafter list's `model` entry: real engine thread, store, widgets and settings files."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QFileDialog

from app.store import COMPLETE
from app.ui.settings_file import read_settings
from app.ui.settings_panel import CHECKING_HELP, NO_DRAFT_HELP
from app.ui.worker import NO_DRAFT_MODEL, ChatSettings

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


# -- the model the app opens on --------------------------------------------------------------

OPENING_APP = """
import os, sys
os.environ["QT_QPA_PLATFORM"] = "offscreen"
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
app = QApplication([])
from app.cli.main import main
from app.ui.main_window import MainWindow

def poll():
    wins = [w for w in app.topLevelWidgets() if isinstance(w, MainWindow)]
    if wins and wins[0].controller.model is not None:
        w = wins[0]
        if os.environ.get("SHOT"):
            w.grab().save(os.environ["SHOT"])
        print("OPENED", w.controller.model.spec, flush=True)
        print("BANNER", w.banner.text.replace("\\n", " | "), flush=True)
        w.close()
        app.quit()
        return
    QTimer.singleShot(20, poll)

QTimer.singleShot(0, poll)
sys.exit(main(sys.argv[1:]))
"""


def open_app(tmp_path: Path, *args: str, shot: Path | None = None) -> dict[str, str]:
    """`understudy [args]` (the app) with its own config and data dirs, until a model has
    loaded: what it opened on and the banner."""
    script = tmp_path / "open_app.py"
    script.write_text(OPENING_APP)
    env = {**os.environ, "PYTHONPATH": str(REPO), "UNDERSTUDY_DATA_DIR": str(tmp_path / "data"),
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "HOME": str(tmp_path),
           "SHOT": str(shot or "")}
    done = subprocess.run([sys.executable, str(script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()
                 if line.startswith(("OPENED ", "BANNER ")))
    return {"opened": lines["OPENED"], "banner": lines.get("BANNER", "")}


def settings_file(tmp_path: Path) -> Path:
    return tmp_path / "config" / "Understudy" / "Understudy.conf"


def test_the_app_reopens_on_the_model_last_used(tiny_pair, tmp_path) -> None:
    """The Target was forgotten on every start (`understudy` always asked for the demo).
    Now `--model` wins for its run, a plain start reopens on the model last used, and one
    that is gone gives way to the demo, with a banner naming it."""
    model = tmp_path / "my-model"
    shutil.copytree(tiny_pair[0], model)
    assert open_app(tmp_path, "--model", str(model))["opened"] == str(model)
    saved = QSettings(str(settings_file(tmp_path)), QSettings.Format.IniFormat)
    assert json.loads(saved.value("chat/settings"))["target"] == str(model)

    again = open_app(tmp_path)
    assert again == {"opened": str(model), "banner": ""}

    shutil.rmtree(model)
    fallen_back = open_app(tmp_path)
    assert fallen_back["opened"] == "demo"
    assert fallen_back["banner"].startswith(f"Could not load model '{model}': ")
    assert fallen_back["banner"].count(str(model)) == 1
    assert fallen_back["banner"].endswith("— opening 'demo' instead.")


def test_model_before_a_command_is_refused_with_the_right_place(capsys) -> None:
    from app.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", "x", "generate", "hi"])
    assert exit_.value.code == 2
    assert "understudy generate --model x" in capsys.readouterr().err


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
    # the model's path is named once, the broken file from its folder
    assert window.banner.text.startswith(f"Could not load model '{bad}': config.json: ")
    assert window.banner.text.count(str(bad)) == 1
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


# -- damaged settings ----------------------------------------------------------------------------

def test_a_settings_file_of_random_bytes_is_kept_aside_and_reported(tmp_path, caplog) -> None:
    path = tmp_path / "Understudy.conf"
    garbage = random.Random(4000).randbytes(4000)  # fixed: random bytes may hold a key
    path.write_bytes(garbage)
    qs = QSettings(str(path), QSettings.Format.IniFormat)
    with caplog.at_level(logging.WARNING, logger="understudy"):
        settings, damage = read_settings(qs)
    assert settings == ChatSettings()
    assert damage is not None and damage.kept is not None
    assert damage.kept.name.startswith("Understudy.conf.damaged-")
    assert damage.kept.read_bytes() == garbage
    assert str(damage.kept) in damage.message()
    assert damage.message().startswith("Your settings could not be read (")
    assert str(path) in caplog.text and "could not be read" in caplog.text
    assert qs.allKeys() == []  # what is written on quit is the app's own keys only


def test_chat_settings_cut_short_are_kept_aside_and_reported(tmp_path, caplog) -> None:
    """A `chat/settings` value cut short read as "nothing saved", without a word."""
    path = tmp_path / "Understudy.conf"
    whole = json.dumps(ChatSettings(target="demo", temperature=0.7).as_dict())
    qs = QSettings(str(path), QSettings.Format.IniFormat)
    qs.setValue("chat/settings", whole[: len(whole) // 2])
    qs.setValue("view/comparison", True)
    qs.sync()
    before = path.read_bytes()
    qs = QSettings(str(path), QSettings.Format.IniFormat)
    with caplog.at_level(logging.WARNING, logger="understudy"):
        settings, damage = read_settings(qs, "some-model")
    assert settings == ChatSettings(target="some-model")
    assert damage is not None and "cut short" in damage.reason
    assert damage.kept is not None and damage.kept.read_bytes() == before
    assert "could not be read" in caplog.text
    assert qs.value("view/comparison") in (True, "true")  # the rest of the file still reads
    # valid JSON with one bad value is no damage: that value alone falls back
    qs.setValue("chat/settings", json.dumps({"temperature": "hot", "seed": 5}))
    assert read_settings(qs) == (ChatSettings(seed=5), None)


def test_the_app_says_when_its_settings_file_is_damaged(tiny_pair, tmp_path,
                                                        screenshots_dir) -> None:
    conf = settings_file(tmp_path)
    conf.parent.mkdir(parents=True)
    garbage = random.Random(3000).randbytes(3000)
    conf.write_bytes(garbage)
    shot = screenshots_dir / "settings_damaged.png"
    opened = open_app(tmp_path, "--model", str(tiny_pair[0]), shot=shot)
    assert opened["opened"] == str(tiny_pair[0])
    assert opened["banner"].startswith("Your settings could not be read (")
    [kept] = conf.parent.glob("Understudy.conf.damaged-*")
    assert kept.read_bytes() == garbage and str(kept) in opened["banner"]
    saved = QSettings(str(conf), QSettings.Format.IniFormat)  # written whole on quit
    assert json.loads(saved.value("chat/settings"))["target"] == str(tiny_pair[0])
    assert read_settings(saved)[1] is None


# -- the drafter list's `model` entry -----------------------------------------------------------

def test_model_drafter_needs_a_usable_draft_model(qtbot, make_gui, tiny_pair, tmp_path,
                                                  monkeypatch) -> None:
    """`model` could be picked with no usable draft model; the reply then failed with the
    command line's words ("pass --draft MODEL")."""
    target, draft = tiny_pair
    gui = make_gui(plain_settings(target))
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    panel = gui.window.settings_panel
    combo = panel.drafter_combo

    def model_entry():
        return combo.model().item(combo.findData("model"))

    assert gui.controller.settings.draft is None
    assert not model_entry().isEnabled() and model_entry().toolTip() == NO_DRAFT_HELP
    assert panel.draft_combo.isEnabled()  # with the drafter off, a draft can still be picked

    choose_folder(monkeypatch, panel.draft_combo, draft)
    qtbot.waitUntil(lambda: gui.controller.settings.draft == str(draft), timeout=TIMEOUT)
    assert model_entry().isEnabled()

    choose_folder(monkeypatch, panel.draft_combo, target)  # the target cannot draft for itself
    qtbot.waitUntil(lambda: "target model itself" in panel.model_status.toolTip(),
                    timeout=TIMEOUT)
    assert gui.controller.settings.draft == str(draft)  # refused: the draft chosen before stays
    gui.controller.set_settings(replace(gui.controller.settings, draft=str(target)))  # restored
    assert not model_entry().isEnabled()
    assert "target model itself" in model_entry().toolTip()


def test_a_failed_reply_leaves_no_two_user_turns_in_a_row(qtbot, make_gui, tiny_pair) -> None:
    """Saved settings may still say `model` with no draft: the reply fails in the app's
    words, and the next message goes to the model as one user turn with the unanswered one
    (templates that require alternating roles refuse two user turns in a row)."""
    gui = make_gui(replace(plain_settings(tiny_pair[0]), drafter="model", draft=None))
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    gui.controller.send("first question")
    wait_idle(qtbot, gui)
    assert gui.window.banner.text == NO_DRAFT_MODEL and "--" not in NO_DRAFT_MODEL
    assert [m.role for m in gui.store.messages(gui.controller.conversation_id)] == ["user"]

    gui.controller.set_settings(replace(gui.controller.settings, drafter="off"))
    gui.controller.send("second question")
    assert gui.controller.current_request.messages == (
        {"role": "user", "content": "first question\n\nsecond question"},)
    wait_idle(qtbot, gui)
    roles = [m.role for m in gui.store.messages(gui.controller.conversation_id)]
    assert roles == ["user", "user", "assistant"]


def swapped_tokenizer_draft(tmp_path: Path) -> Path:
    """A tiny draft whose tokenizer maps two ids to each other's strings."""
    from tests.fixtures.tiny_models import write_tiny_model

    swapped = write_tiny_model(tmp_path / "swapped-draft", hidden_size=32, seed=3)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (k for k, i in vocab.items() if i in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    return swapped


def test_a_draft_with_another_tokenizer_is_refused_and_never_said_ready(
        qtbot, make_gui, tiny_pair, tmp_path) -> None:
    """The draft was loaded whole and the panel said "Draft … ready" beside the banner saying
    it cannot draft; it is now refused from its tokenizer files, before its weights."""
    target = tiny_pair[0]
    swapped = swapped_tokenizer_draft(tmp_path)
    gui = make_gui(replace(plain_settings(target), drafter="model", draft=str(swapped)))
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    loading: list[str] = []
    gui.host.worker.model_loading.connect(loading.append)
    gui.controller.send("Hello there")
    wait_idle(qtbot, gui)
    assert gui.window.banner.text.startswith(f"{swapped} cannot draft for {target}: ")
    assert "2 token ids map to different strings" in gui.window.banner.text
    assert gui.window.settings_panel.model_status.text() == (
        f"tiny-target · {gui.controller.model.model_type} · {gui.controller.model.backend}")
    assert loading == []
    assert [m.role for m in gui.store.messages(gui.controller.conversation_id)] == ["user"]


def test_a_model_without_chat_template_is_a_short_note_beside_the_banner(
        qtbot, make_gui, tmp_path, screenshots_dir) -> None:
    """The side panel repeated the banner's whole warning under Target, six wrapped lines
    in a row with room for five, cut off at the top and bottom."""
    from tests.fixtures.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "plain")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    from engine.tokenizer import ChatTemplateWarning

    with pytest.warns(ChatTemplateWarning, match="has no chat template"):  # said once, here
        gui = make_gui(plain_settings(folder))
        qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    gui.window.resize(1100, 700)
    status = gui.window.settings_panel.model_status
    qtbot.waitUntil(lambda: status.text().startswith("plain · "), timeout=TIMEOUT)
    warning = gui.controller.model.template_warning
    assert warning is not None and "has no chat template" in warning
    assert gui.window.banner.text == warning
    assert status.text() == (f"plain · {gui.controller.model.model_type} · "
                             f"{gui.controller.model.backend}\nNo chat template")
    assert status.toolTip() == warning
    # nothing cut off, once the layout has taken the new text
    qtbot.waitUntil(lambda: status.height() >= status.heightForWidth(status.width()),
                    timeout=3000)
    gui.window.grab().save(str(screenshots_dir / "model_without_chat_template.png"))


def test_the_draft_picker_refuses_a_folder_whose_tokenizer_differs_before_a_message(
        qtbot, make_gui, tiny_pair, tmp_path, monkeypatch, screenshots_dir) -> None:
    """Choose a folder… took any draft; its tokenizer was only checked once a message was
    sent. Now the picker checks it (tokenizer files only) and says why it cannot draft, and
    a draft restored from earlier settings says so on hover."""
    target = tiny_pair[0]
    swapped = swapped_tokenizer_draft(tmp_path)
    gui = make_gui(plain_settings(target))
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    panel = gui.window.settings_panel

    choose_folder(monkeypatch, panel.draft_combo, swapped)
    qtbot.waitUntil(lambda: "cannot draft" in panel.model_status.text(), timeout=TIMEOUT)
    assert panel.model_status.text() == "swapped-draft cannot draft for this target"
    assert panel.model_status.toolTip().startswith("Cannot draft for this target: ")
    assert "2 token ids map to different strings" in panel.model_status.toolTip()
    assert gui.controller.settings.draft is None
    assert panel.draft_combo.currentData() is None
    gui.window.grab().save(str(screenshots_dir / "draft_refused_in_picker.png"))

    choose_folder(monkeypatch, panel.draft_combo, tiny_pair[1])  # a draft that pairs is taken
    qtbot.waitUntil(lambda: gui.controller.settings.draft == str(tiny_pair[1]), timeout=TIMEOUT)
    assert panel.draft_combo.toolTip() == "The model that drafts for the model and auto drafters"
    assert panel.model_status.text().startswith("tiny-target · ")  # the refusal is over
    assert panel.model_status.toolTip() == ""

    gui.controller.set_settings(replace(gui.controller.settings, draft=str(swapped)))
    assert panel.draft_combo.toolTip().startswith("Cannot draft for this target: ")
    assert "2 token ids map to different strings" in panel.draft_combo.toolTip()
    assert not panel.drafter_combo.model().item(panel.drafter_combo.findData("model")).isEnabled()


def test_the_draft_picker_reads_tokenizers_off_the_gui_thread(qtbot, make_gui, tmp_path,
                                                              monkeypatch) -> None:
    """The picker compared each candidate's tokenizer.json with the target's on the GUI
    thread, and a 10+ MB one froze the window while it was read. Now the entry says it is
    being checked while another thread reads, and the verdict, once in, is kept."""
    from app.hub import model_choices
    from tests.fixtures.tiny_models import write_tiny_model

    target = write_tiny_model(tmp_path / "slow-target", seed=0)  # no verdict cached yet
    draft = write_tiny_model(tmp_path / "slow-draft", seed=0, hidden_size=32)
    compare = model_choices.check_draft_compatible
    readers: list[threading.Thread] = []
    read_done = threading.Event()  # the stand-in for a large tokenizer.json being read

    def slow_compare(t: Path, d: Path):
        readers.append(threading.current_thread())
        read_done.wait(timeout=5)
        return compare(t, d)

    monkeypatch.setattr(model_choices, "check_draft_compatible", slow_compare)
    gui = make_gui(replace(plain_settings(target), draft=str(draft)))
    qtbot.waitUntil(lambda: len(readers) > 0, timeout=TIMEOUT)
    assert readers[0] is not threading.main_thread()
    panel = gui.window.settings_panel
    qtbot.waitUntil(lambda: panel.draft_reason(str(draft)) is not None, timeout=TIMEOUT)
    # while the read goes on, the entry and the `model` drafter say why they wait
    assert panel.draft_reason(str(draft)) == CHECKING_HELP
    entry = panel.draft_combo.findData(str(draft))
    assert panel.draft_combo.itemText(entry) == "slow-draft (checking…)"
    model_entry = panel.drafter_combo.model().item(panel.drafter_combo.findData("model"))
    assert not model_entry.isEnabled() and model_entry.toolTip() == CHECKING_HELP

    read_done.set()
    qtbot.waitUntil(lambda: panel.draft_reason(str(draft)) is None, timeout=TIMEOUT)
    assert panel.draft_combo.itemText(entry) == "slow-draft"
    assert model_entry.isEnabled()
    reads = len(readers)
    panel.refresh_models()  # the verdict is kept: answered at once, nothing read again
    assert panel.draft_reason(str(draft)) is None and len(readers) == reads
