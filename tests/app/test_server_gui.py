"""Server ▸ Start/Stop in the app: requests run on the app's own engine worker."""

from __future__ import annotations

import openai
import pytest
from PySide6.QtGui import QGuiApplication

from app.ui.worker import ChatSettings

TIMEOUT = 60_000


def test_server_menu_serves_through_the_app_worker(qtbot, make_gui, tiny_pair,
                                                   screenshots_dir) -> None:
    target, draft = tiny_pair
    gui = make_gui(ChatSettings(target=str(target), draft=str(draft), drafter="auto",
                                max_tokens=24))
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    window = gui.window
    panel = window.server_panel
    panel.port_spin.setValue(0)  # any free port
    window.server_start_action.trigger()
    assert panel.running and panel.url is not None
    assert panel.address_label.text() == f"Listening on {panel.url}"
    assert not window.server_start_action.isEnabled() and window.server_stop_action.isEnabled()
    assert f'base_url="{panel.url}"' in panel.snippet.toPlainText()
    panel.copy_button.click()
    assert QGuiApplication.clipboard().text() == panel.snippet.toPlainText()

    client = openai.OpenAI(base_url=panel.url, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    assert model == gui.controller.model.name
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello world"}], max_tokens=6,
        temperature=0)
    assert reply.usage.completion_tokens == 6
    qtbot.waitUntil(lambda: panel.log_model.rowCount() == 1, timeout=TIMEOUT)
    record = panel.log_model.record(0)
    assert (record.endpoint, record.completion_tokens, record.finish) == ("chat", 6, "length")

    def sample(**kw) -> str:
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "the cat sat on the mat"}],
            max_tokens=12, temperature=1.0, **kw).choices[0].message.content

    # as under `understudy serve`: no seed, each request samples anew (a client's
    # "regenerate" gets another reply); a seed makes it repeatable
    assert sample() != sample()
    assert sample(seed=4) == sample(seed=4)

    # the chat still works with the server on the same worker
    gui.controller.send("Hi there")
    qtbot.waitUntil(lambda: not gui.controller.generating, timeout=TIMEOUT)
    assert [m.role for m in gui.controller.messages()][-2:] == ["user", "assistant"]

    panel.resize(820, 520)
    panel.grab().save(str(screenshots_dir / "server_panel.png"))
    url = panel.url
    window.server_stop_action.trigger()
    assert not panel.running and panel.address_label.text() == "Stopped"
    assert window.server_start_action.isEnabled()
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=5).models.list()


def test_server_off_loopback_needs_a_key(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(ChatSettings(target=str(tiny_pair[0]), drafter="off"))
    panel = gui.window.server_panel
    panel.host_edit.setText("0.0.0.0")
    panel.port_spin.setValue(0)
    assert panel.start_server() is False
    assert "--api-key" in panel.address_label.text() and not panel.running
