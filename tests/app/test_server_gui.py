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


def test_server_off_loopback_needs_a_key(qtbot, make_gui, tiny_pair, screenshots_dir) -> None:
    gui = make_gui(ChatSettings(target=str(tiny_pair[0]), drafter="off"))
    panel = gui.window.server_panel
    panel.host_edit.setText("0.0.0.0")
    panel.port_spin.setValue(0)
    panel.show()
    panel.resize(760, 520)
    assert panel.start_server() is False
    text = panel.address_label.text()
    assert not panel.running
    # it names the panel's own field, not the command line's flag
    assert "“API key”" in text and "--api-key" not in text and "0.0.0.0" in text
    # the long reason wraps in the panel instead of widening it
    qtbot.waitUntil(lambda: panel.address_label.height()
                    >= 2 * panel.address_label.fontMetrics().lineSpacing())
    panel.grab().save(str(screenshots_dir / "server_needs_key.png"))
    assert panel.width() == 760 and panel.minimumSizeHint().width() <= 760
    assert panel.address_label.geometry().right() < panel.width()


def test_rejected_requests_reach_the_log_and_its_columns_fit(qtbot, make_gui, tiny_pair,
                                                             screenshots_dir) -> None:
    """Someone debugging a client looks at the log: a request refused before the engine
    (a body without "model") is a row with its status and message; and at the panel's
    default size no column is cut to "01…"."""
    import json
    import urllib.error
    import urllib.request

    gui = make_gui(ChatSettings(target=str(tiny_pair[0]), drafter="off", max_tokens=4))
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    panel = gui.window.server_panel
    panel.port_spin.setValue(0)
    panel.show()
    assert panel.start_server()

    def post(body: dict) -> int:
        request = urllib.request.Request(f"{panel.url}/chat/completions",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status
        except urllib.error.HTTPError as e:
            return e.code

    messages = [{"role": "user", "content": "Hello world"}]
    status = post({"messages": messages})
    assert status in (400, 422)
    qtbot.waitUntil(lambda: panel.log_model.rowCount() == 1, timeout=TIMEOUT)
    rejected = panel.log_model.record(0)
    assert (rejected.endpoint, rejected.status) == ("chat", status)
    assert "model" in rejected.finish and rejected.finish.startswith("error: ")
    model = panel.log_model
    cells = [model.data(model.index(0, c)) for c in range(model.columnCount())]
    assert cells[1:3] == ["chat", str(status)] and cells[-1] == rejected.finish

    assert post({"model": gui.controller.model.name, "messages": messages}) == 200
    qtbot.waitUntil(lambda: panel.log_model.rowCount() == 2, timeout=TIMEOUT)
    assert panel.log_model.record(1).status == 200
    panel.resize(760, 520)
    view = panel.log_view
    qtbot.waitUntil(lambda: view.viewport().width() > 500)
    panel.grab().save(str(screenshots_dir / "server_log_columns.png"))
    metrics = view.fontMetrics()
    for column, name in enumerate(model.HEADERS[:-1]):
        for row in range(model.rowCount()):
            text = model.data(model.index(row, column)) or ""
            if name != "Model":  # a long model id may give way, cut at its end
                assert metrics.horizontalAdvance(text) < view.columnWidth(column), (name, text)
    panel.stop_server()


def test_server_panel_allows_the_web_pages_named(qtbot, make_gui, tiny_pair,
                                                 screenshots_dir) -> None:
    """The panel's Web pages field is the CLI's --allow-origin: a bad entry is named and
    the server not started; the pages named get CORS answers, others none."""
    import http.client
    from urllib.parse import urlsplit

    gui = make_gui(ChatSettings(target=str(tiny_pair[0]), drafter="off"))
    panel = gui.window.server_panel
    panel.port_spin.setValue(0)
    panel.show()
    panel.origins_edit.setText("localhost:3000")
    assert panel.start_server() is False
    assert panel.address_label.text().startswith("Not started: Web pages: 'localhost:3000'")
    panel.origins_edit.setText("http://localhost:3000, https://chat.example")
    assert panel.start_server() is True
    assert not panel.origins_edit.isEnabled()  # as the other settings, fixed while running
    panel.grab().save(str(screenshots_dir / "server_web_pages.png"))
    url = urlsplit(panel.url)

    def allowed(origin: str) -> str | None:
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        conn.request("OPTIONS", "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        response = conn.getresponse()
        response.read()
        conn.close()
        return response.getheader("access-control-allow-origin")

    assert allowed("https://chat.example") == "https://chat.example"
    assert allowed("http://localhost:3000") == "http://localhost:3000"
    assert allowed("http://other.example") is None
    panel.drafter_combo.setCurrentText("ngram")
    panel.stop_server()
    gui.window.save_state()
    gui.close()

    # the next run's panel opens with what the last server that started was given
    again = make_gui(ChatSettings(target=str(tiny_pair[0]), drafter="off"))
    restored = again.window.server_panel
    assert restored.origins_edit.text() == "http://localhost:3000, https://chat.example"
    assert restored.port_spin.value() == 0 and restored.key_edit.text() == ""  # no secret
    assert restored.drafter_combo.currentText() == "auto"  # changed after it started
    again.close()
    # hand-damaged values leave their fields at the defaults, the rest is restored
    again.qsettings.setValue("server/port", "eighty")
    again.qsettings.setValue("server/drafter", "oracle")
    again.qsettings.sync()
    third = make_gui(ChatSettings(target=str(tiny_pair[0]), drafter="off"))
    panel3 = third.window.server_panel
    assert panel3.port_spin.value() == 1234 and panel3.drafter_combo.currentText() == "auto"
    assert panel3.origins_edit.text() == "http://localhost:3000, https://chat.example"
