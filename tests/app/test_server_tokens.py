"""The extension's per-token texts when byte tokens split a character, over HTTP.

A chain model writes CHAIN_TEXT ("Hé🦊 fox!", the fox emoji four byte tokens) greedily; a
predicted output with a wolf instead makes prompt lookup draft the wolf's bytes, so the
target rejects a draft in the middle of an emoji.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from app.server.api import create_app
from app.server.engine_thread import EngineSpec, EngineThread
from app.server.run import BackgroundServer
from tests.engine.test_decode import CHAIN_TEXT, USER, write_chain_model

WOLF_TEXT = CHAIN_TEXT.replace("🦊", "🐺")  # the emojis share their first two bytes


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    chain = write_chain_model(tmp_path_factory.mktemp("server-tokens") / "chain")
    engine = EngineThread(EngineSpec(str(chain), None, "ngram"))
    engine.start()
    server = BackgroundServer(create_app(engine), port=0)
    server.start()
    yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    server.stop()
    engine.close()


def test_a_token_that_holds_part_of_a_character_is_never_a_replacement_mark(
        client: openai.OpenAI) -> None:
    """Rejected draft tokens were each decoded alone, so the wolf's last two bytes went
    out as two U+FFFD. A token that holds part of a character now has the text "" and
    the one that completes it carries it whole, drafted or committed: joining the texts
    of the reply's tokens, or of a rejected branch, reads as their text."""
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=USER, max_tokens=20, temperature=0,
        stream=True, prediction={"type": "content", "content": WOLF_TEXT},
        extra_body={"drafter": "ngram", "draft_k": 8})
    tokens = [t for chunk in stream for t in (chunk.model_extra or {}).get("understudy", {})
              .get("tokens", [])]
    assert not [t for t in tokens if "\ufffd" in t["text"]]
    assert "".join(t["text"] for t in tokens if t["kind"] != "rejected") == CHAIN_TEXT
    # drafted from the prediction: é, 🐺, " f"; the target took é and the emoji's first two
    # bytes, and wrote 🦊 where the wolf's other two were drafted
    assert [t["text"] for t in tokens if t["kind"] == "rejected"] == ["", "🐺", " ", "f"]
    emoji = [t for t in tokens if t["kind"] != "rejected"][3:7]
    assert [t["text"] for t in emoji] == ["", "", "", "🦊"]
    assert {t["kind"] for t in emoji[:2]} == {"accepted"}
