"""The server on the demo model: a bounded load test, and speculation staying lossless.

8 streaming clients x 5 requests each, all at once on loopback: every request completes,
and its streamed text (and the committed tokens in the extension field) equals the same
request run alone. Small max_tokens keeps it short (80 requests of a few tokens each).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from app.server.api import ServerConfig, create_app
from app.server.engine_thread import EngineSpec, EngineThread
from app.server.run import BackgroundServer
from tests.app.test_server import ext, stream_text

pytestmark = pytest.mark.slow

CLIENTS, PER_CLIENT, MAX_TOKENS = 8, 5, 6
TOPICS = ("cats", "rain", "trains", "bread", "chess", "rivers", "music", "stars")


@pytest.fixture(scope="module")
def demo_server(demo_model_dir: Path) -> Iterator[tuple[BackgroundServer, str]]:
    engine = EngineThread(EngineSpec(str(demo_model_dir), None, "auto"))
    card = engine.start()
    server = BackgroundServer(create_app(engine, ServerConfig(max_waiting=CLIENTS)), port=0)
    server.start()
    yield server, card.id
    server.stop()
    engine.close()


def _request(client_no: int, i: int) -> dict:
    return {"messages": [{"role": "user",
                          "content": f"Write one sentence about {TOPICS[client_no]}."}],
            "max_tokens": MAX_TOKENS, "temperature": 0.7, "seed": 100 * client_no + i}


def test_eight_streaming_clients_get_their_own_text(demo_server) -> None:
    server, model = demo_server
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
    alone = {(c, i): client.chat.completions.create(model=model, **_request(c, i))
             .choices[0].message.content for c in range(CLIENTS) for i in range(PER_CLIENT)}
    assert len(set(alone.values())) > CLIENTS  # the requests really differ
    got: dict[tuple[int, int], str] = {}
    failures: list[str] = []

    def run(c: int) -> None:
        try:
            for i in range(PER_CLIENT):
                text, chunks, tokens = stream_text(client.chat.completions.create(
                    model=model, stream=True, **_request(c, i)))
                assert "".join(tokens) == text  # no token lost, doubled or from elsewhere
                assert chunks[-1].usage is not None
                got[(c, i)] = text
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            failures.append(f"client {c}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not failures, failures
    assert len(got) == CLIENTS * PER_CLIENT
    for key, text in got.items():
        assert text == alone[key], key


def test_code_edit_speculative_equals_plain(demo_server) -> None:
    server, model = demo_server
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
    code = ("def total(values):\n    x = 0\n    for v in values:\n        x = x + v\n"
            "    return x\n")
    messages = [{"role": "user", "content": "Rename the variable `x` to `count`. Reply with "
                 f"the full updated code only.\n\n```python\n{code}```"}]

    def run(drafter: str):
        return client.chat.completions.create(model=model, messages=messages, max_tokens=48,
                                              temperature=0, extra_body={"drafter": drafter})

    plain, spec = run("none"), run("ngram")
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert ext(spec)["accepted"] > 0 and ext(plain)["drafted"] == 0


def test_a_reply_cut_short_is_continued_as_one_written_whole(demo_server) -> None:
    """`continue_final_message` (vLLM's extension): a reply cut at 20 tokens and continued
    for 20 more reads as the same reply written to 40 at once."""
    server, model = demo_server
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
    question = [{"role": "user", "content": "Tell me about octopuses."}]

    def reply(messages: list[dict], n: int, **extra) -> str:
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=n,
                                             temperature=0, extra_body=extra or None)
        return out.choices[0].message.content

    whole, half = reply(question, 40), reply(question, 20)
    cut = [*question, {"role": "assistant", "content": half}]
    assert half + reply(cut, 20, continue_final_message=True) == whole
    assert half + reply(cut, 20) != whole  # negative control: a new reply after it
