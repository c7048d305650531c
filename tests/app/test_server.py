"""The OpenAI-compatible server on 127.0.0.1, driven by the official `openai` client.

One standalone engine thread over a tiny random target and draft serves every app in this
module (each app has its own queue and key policy, as `create_app` allows). Raw HTTP
(http.client) covers the bad-input table, where the client library would refuse to send.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest

from app.cli import main
from app.server.api import ServerConfig, create_app
from app.server.engine_thread import EngineSpec, EngineThread
from app.server.jobs import ModelCard
from app.server.run import BackgroundServer, check_bind
from engine.errors import EngineError
from engine.tokenizer import Tokenizer
from tests.fixtures.tiny_models import write_tiny_pair

LONG = 1900  # greedy tiny-model replies to HELLO run this long without eos (~10 s)
HELLO = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineThread]:
    target, draft = write_tiny_pair(tmp_path_factory.mktemp("server"))
    thread = EngineThread(EngineSpec(str(target), str(draft), "auto"))
    thread.start()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def card(engine: EngineThread) -> ModelCard:
    return engine.models()[0]


@pytest.fixture(scope="module")
def serve(engine: EngineThread) -> Iterator[Callable[..., BackgroundServer]]:
    """Start an app over the shared engine with a given ServerConfig; stopped at the end."""
    started: list[BackgroundServer] = []

    def start(config: ServerConfig | None = None) -> BackgroundServer:
        server = BackgroundServer(create_app(engine, config), port=0)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def server(serve) -> BackgroundServer:
    return serve()


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def jobs(server: BackgroundServer):
    return server.app.state.jobs


def wait_idle(server: BackgroundServer, timeout: float = 30.0) -> None:
    """Until the engine has ended every job this app submitted."""
    deadline = time.monotonic() + timeout
    while jobs(server).in_flight:
        assert time.monotonic() < deadline, "the engine did not end its jobs"
        time.sleep(0.02)


def ext(obj) -> dict:
    return (obj.model_extra or {}).get("understudy") or {}


def stream_text(stream) -> tuple[str, list, list]:
    """Content of a chat stream, its chunks, and the committed token texts of the extension."""
    parts, chunks, tokens = [], [], []
    for chunk in stream:
        chunks.append(chunk)
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        tokens += [t["text"] for t in ext(chunk).get("tokens", []) if t["kind"] != "rejected"]
    return "".join(parts), chunks, tokens


# ---------------------------------------------------------------------------- happy paths


def test_models_lists_the_served_model(client: openai.OpenAI, card: ModelCard) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [card.id]
    assert ext(models[0])["context_window"] == 2048


def test_models_retrieve_one(client: openai.OpenAI, server: BackgroundServer,
                             card: ModelCard) -> None:
    """`GET /v1/models/{id}`: the served model's object, as listed; an unknown id is a 404."""
    model = client.models.retrieve(card.id)
    assert model.model_dump() == client.models.list().data[0].model_dump()
    assert (model.id, model.object, model.owned_by) == (card.id, "model", "understudy")
    # a base URL ending in "/" has clients ask for "/v1/models/": the list, not model ''
    status, listed = raw(server, "GET", "/v1/models/", None, {})
    assert status == 200 and [m["id"] for m in listed["data"]] == [card.id]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-9")
    assert err.value.body["code"] == "model_not_found"
    assert "'gpt-9' is not served here" in err.value.body["message"]


def test_chat_usage_and_stream_match(client: openai.OpenAI, card: ModelCard) -> None:
    ids = card.tokenizer.encode_chat(HELLO)
    reply = client.chat.completions.create(model=card.id, messages=HELLO, max_tokens=12,
                                           temperature=0.8, seed=3)
    assert reply.object == "chat.completion"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == len(ids) + 12
    stats = ext(reply)
    assert {"drafted", "accepted", "tau", "drafter"} <= stats.keys()
    assert stats["drafter"] == "auto"

    stream = client.chat.completions.create(
        model=card.id, messages=HELLO, max_tokens=12, temperature=0.8, seed=3, stream=True,
        stream_options={"include_usage": True})
    text, chunks, tokens = stream_text(stream)
    assert text == reply.choices[0].message.content
    assert "".join(tokens) == text  # every committed token's text, none lost or doubled
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # reported once, as OpenAI does: a client adding up every chunk's usage counts 12
    assert sum(c.usage.completion_tokens for c in chunks if c.usage) == 12


def test_a_stream_without_include_usage_reports_it_on_the_finish(client: openai.OpenAI,
                                                                 card: ModelCard) -> None:
    for endpoint in (client.chat.completions, client.completions):
        body = {"messages": HELLO} if endpoint is client.chat.completions else {"prompt": "Hi"}
        chunks = list(endpoint.create(model=card.id, max_tokens=5, seed=1, stream=True, **body))
        assert chunks[-1].choices[0].finish_reason == "length"
        assert [c.usage.completion_tokens for c in chunks if c.usage] == [5]
        with_usage = list(endpoint.create(model=card.id, max_tokens=5, seed=1, stream=True,
                                          stream_options={"include_usage": True}, **body))
        assert with_usage[-2].usage is None and with_usage[-1].choices == []
        assert [c.usage.completion_tokens for c in with_usage if c.usage] == [5]


def test_completions_raw_prompt_no_template(client: openai.OpenAI, card: ModelCard) -> None:
    prompt = "def add(a, b):"
    reply = client.completions.create(model=card.id, prompt=prompt, max_tokens=8,
                                      temperature=0)
    assert reply.object == "text_completion"
    assert reply.usage.prompt_tokens == len(card.tokenizer.encode(prompt,
                                                                  add_special_tokens=True))
    assert reply.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=card.id, prompt=prompt, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == reply.choices[0].text


def test_completions_take_a_prompt_as_token_ids(client: openai.OpenAI,
                                                card: ModelCard) -> None:
    """OpenAI's token-id forms of `prompt` (lm-evaluation-harness sends them): the ids are
    read as given, so the reply is the text prompt's when they are its tokens."""
    prompt = "def add(a, b):"
    ids = card.tokenizer.encode(prompt, add_special_tokens=True)

    def text(given) -> tuple[str, int]:
        reply = client.completions.create(model=card.id, prompt=given, max_tokens=8,
                                          temperature=0.9, seed=4)
        return reply.choices[0].text, reply.usage.prompt_tokens

    assert text(ids) == text([ids]) == text(prompt) == (text(prompt)[0], len(ids))
    assert text(ids[1:])[0] != text(ids)[0]  # the ids are read, not the text behind them


def test_text_parts_are_joined(client: openai.OpenAI, card: ModelCard) -> None:
    """OpenAI's list-of-parts content, all text: read as the parts joined."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": " world"}]

    def reply(content) -> str:
        return client.chat.completions.create(
            model=card.id, messages=[{"role": "user", "content": content}], max_tokens=6,
            temperature=0).choices[0].message.content

    assert reply(parts) == reply("Hello world")


def test_a_reply_cut_mid_character_sends_no_replacement_mark(client: openai.OpenAI,
                                                             card: ModelCard) -> None:
    """max_tokens ending inside a multi-byte character: the incomplete character is left
    out (never sent as U+FFFD), streamed and whole alike. The tiny byte-level model writes
    the odd multi-byte character; a longer reply with the same seed shows where one is cut
    (sampling at a position depends on the seed and the position only)."""
    mark, decode = "\ufffd", card.tokenizer.decode

    def chat(n: int, seed: int, **kw):
        return client.chat.completions.create(
            model=card.id, messages=[{"role": "user", "content": "the cat sat on the mat"}],
            max_tokens=n, temperature=1.0, seed=seed, extra_body={"drafter": "none"}, **kw)

    def cut(seed: int) -> tuple[int, str] | None:
        """A token count that ends inside a character the next token completes."""
        _, chunks, _ = stream_text(chat(80, seed, stream=True))
        ids = [t["id"] for c in chunks for t in ext(c).get("tokens", [])]
        for n in range(1, len(ids)):
            text, longer = decode(ids[:n]), decode(ids[:n + 1])
            end = len(text) - 1
            if (text.endswith(mark) and not text[:end].endswith(mark)
                    and longer[:end] == text[:end] and len(longer) > end
                    and longer[end] != mark and not longer[end].isascii()):
                return n, text[:end]
        return None

    seed, (n, expected) = next((seed, found) for seed in range(16)
                               if (found := cut(seed)) is not None)
    whole = chat(n, seed)
    assert whole.usage.completion_tokens == n
    assert whole.choices[0].message.content == expected
    streamed, _, tokens = stream_text(chat(n, seed, stream=True))
    assert streamed == expected
    assert "".join(tokens) == expected  # the extension's token texts say the same


def test_stop_string_ends_the_reply(client: openai.OpenAI, card: ModelCard) -> None:
    def chat(**kw):
        return client.chat.completions.create(model=card.id, messages=HELLO, max_tokens=24,
                                              temperature=0, **kw)

    full = chat().choices[0].message.content
    # a piece of the reply after its start (the tiny model writes some bytes that are not
    # text; a stop string is text)
    start = next(i for i in range(1, len(full) - 2) if full[i:i + 3].isascii()
                 and full[i:i + 3].strip() and full[i:i + 3].isprintable())
    stop = full[start:start + 3]
    cut = chat(stop=[stop, "never-there"])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed, _, _ = stream_text(chat(stop=stop, stream=True))
    assert streamed == full[: full.index(stop)]


def test_seed_determinism_and_speculation_is_lossless(client: openai.OpenAI,
                                                      card: ModelCard) -> None:
    def run(drafter: str, seed: int = 11) -> tuple[str, dict]:
        reply = client.chat.completions.create(
            model=card.id, messages=[{"role": "user", "content": "the cat sat on the mat"}],
            max_tokens=40, temperature=0.9, seed=seed,
            # a pinned draft length: under a busy machine's timings the cost model may
            # choose plain steps throughout, and then nothing here would be speculative
            extra_body={"drafter": drafter, "draft_k": 3})
        return reply.choices[0].message.content, ext(reply)

    plain, plain_stats = run("none")
    assert plain_stats["drafted"] == 0
    assert run("none")[0] == plain  # same seed, same text
    assert run("none", seed=12)[0] != plain  # negative control: the seed matters
    for drafter in ("model", "layerskip", "auto"):
        text, stats = run(drafter)
        assert text == plain, drafter
        assert stats["drafted"] > 0, drafter  # speculation really ran


def test_without_a_seed_each_request_samples_anew(client: openai.OpenAI,
                                                  card: ModelCard) -> None:
    """OpenAI's semantics: no seed, a fresh one per request (a client's "regenerate" gets
    another reply); the same seed, the same reply; speculation lossless under either."""
    def run(drafter: str = "none", **kw) -> str:
        return client.chat.completions.create(
            model=card.id, messages=[{"role": "user", "content": "the cat sat on the mat"}],
            max_tokens=16, temperature=1.0, extra_body={"drafter": drafter, "draft_k": 3},
            **kw).choices[0].message.content

    # fresh seeds give other replies; two may still agree (the tiny model sometimes ends
    # at once, an empty reply), four all alike would mean one seed reused
    unseeded = {run() for _ in range(4)}
    assert len(unseeded) >= 2
    assert run(seed=7) == run(seed=7) == run("model", seed=7)
    # -1 is "random" to llama.cpp-style clients; other negatives (OpenAI's seeds are int64)
    # repeat like any seed, as the same 64 bits unsigned
    assert len({run(seed=-1) for _ in range(4)}) >= 2
    assert run(seed=-5) == run(seed=2**64 - 5) != run(seed=5)


def test_sampling_extensions_are_honoured_and_stay_lossless(client: openai.OpenAI,
                                                             card: ModelCard) -> None:
    """top_k, min_p and the repetition penalty (under both names) reach the sampler: each
    changes the reply from the plain default, and speculation still matches plain."""
    def run(drafter: str, **extra) -> str:
        reply = client.chat.completions.create(
            model=card.id, messages=[{"role": "user", "content": "the cat sat on the mat"}],
            max_tokens=40, temperature=0.9, seed=5,
            extra_body={"drafter": drafter, "draft_k": 3, **extra})
        return reply.choices[0].message.content

    default = run("none")
    assert run("none", top_k=0, min_p=0.0, repetition_penalty=1.0) == default  # the offs
    for extra in ({"top_k": 1}, {"min_p": 0.5}, {"repetition_penalty": 3.0}):
        plain = run("none", **extra)
        assert plain != default, extra  # the field was not ignored
        assert run("model", **extra) == plain, extra
    assert run("none", repeat_penalty=3.0) == run("none", repetition_penalty=3.0)


def test_follow_up_prefills_only_new_tokens(client: openai.OpenAI, card: ModelCard) -> None:
    """An editor's follow-up repeating the file reuses the cached prefix."""
    file = "def add(a, b):\n    return a + b\n" * 30
    first = [{"role": "system", "content": file}, {"role": "user", "content": "Explain it."}]
    second = [{"role": "system", "content": file}, {"role": "user", "content": "Rename b."}]
    client.chat.completions.create(model=card.id, messages=first, max_tokens=4,
                                   temperature=0)
    b = client.chat.completions.create(model=card.id, messages=second, max_tokens=4,
                                       temperature=0)
    ids_a, ids_b = card.tokenizer.encode_chat(first), card.tokenizer.encode_chat(second)
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
    assert shared > 300
    assert b.usage.prompt_tokens == len(ids_b)
    assert ext(b)["prefilled_tokens"] == len(ids_b) - shared
    assert b.usage.prompt_tokens_details.cached_tokens == shared  # OpenAI's field for it


def test_two_clients_conversations_each_keep_their_cache(client: openai.OpenAI,
                                                         card: ModelCard) -> None:
    """Two editors' conversations, interleaved: each follow-up reads only its new message,
    the other conversation's cache parked meanwhile (`engine.prefix_store`)."""
    convos = {name: [{"role": "user", "content": f"{name}: " + f"the {name} is here. " * 50}]
              for name in ("cat", "ship")}
    for messages in convos.values():
        reply = client.chat.completions.create(model=card.id, messages=messages,
                                               max_tokens=4, temperature=0)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "And then?"}]
    for messages in convos.values():
        again = client.chat.completions.create(model=card.id, messages=messages,
                                               max_tokens=4, temperature=0)
        prompt = card.tokenizer.encode_chat(messages)
        assert again.usage.prompt_tokens == len(prompt) > 300
        assert again.usage.prompt_tokens_details.cached_tokens > len(prompt) - 40


def test_a_prediction_is_drafted_from_and_changes_no_text(client: openai.OpenAI,
                                                          card: ModelCard) -> None:
    """OpenAI's Predicted Outputs: prompt lookup drafts from the predicted text, the reply is
    the one plain decoding writes, and usage says how much of the prediction it wrote."""
    def reply(drafter: str, prediction: str | None = None, **sampling):
        extra = {"prediction": {"type": "content", "content": prediction}} if prediction else {}
        return client.chat.completions.create(
            model=card.id, messages=HELLO, max_tokens=40, extra_body={"drafter": drafter},
            **sampling, **extra)

    plain = reply("none", temperature=0)
    text = plain.choices[0].message.content
    predicted = reply("ngram", text, temperature=0)
    unaided = reply("ngram", temperature=0)
    wrong = reply("ngram", "Completely unrelated words about the sea. " * 4, temperature=0)
    assert (predicted.choices[0].message.content == unaided.choices[0].message.content
            == wrong.choices[0].message.content == text)
    # the whole reply was predicted: most of it is copied, several tokens a pass
    assert ext(predicted)["tau"] >= 3.0 > ext(unaided)["tau"]
    used = predicted.usage.completion_tokens_details
    n_predicted = len(card.tokenizer.encode(text))
    assert used.accepted_prediction_tokens >= 0.9 * n_predicted
    assert used.accepted_prediction_tokens + used.rejected_prediction_tokens == n_predicted
    assert wrong.usage.completion_tokens_details.accepted_prediction_tokens < 0.3 * n_predicted
    assert unaided.usage.completion_tokens_details is None  # no prediction, no count
    # sampled: the same seed writes the same text with or without a prediction
    sampled = reply("none", temperature=0.8, seed=11).choices[0].message.content
    assert reply("ngram", sampled, temperature=0.8, seed=11).choices[0].message.content == sampled
    # streamed, list-of-parts content: usage carries the count too
    stream = client.chat.completions.create(
        model=card.id, messages=HELLO, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"drafter": "ngram"},
        prediction={"type": "content", "content": [{"type": "text", "text": text}]})
    last = list(stream)[-1]
    assert last.usage.completion_tokens_details.accepted_prediction_tokens == \
        used.accepted_prediction_tokens


# ---------------------------------------------------------------------------- queue, cancel


def test_disconnect_cancels_generation(client: openai.OpenAI, server: BackgroundServer,
                                       card: ModelCard) -> None:
    n_records = len(jobs(server).records)
    stream = client.chat.completions.create(model=card.id, messages=HELLO, max_tokens=LONG,
                                            temperature=0, stream=True,
                                            extra_body={"drafter": "none"})
    received = 0
    for chunk in stream:
        received += len(ext(chunk).get("tokens", []))
        if received >= 3:
            break
    stream.close()
    wait_idle(server)
    record = jobs(server).records[n_records]
    assert record.finish == "cancelled"
    # the engine stopped soon after the client left, far short of the LONG reply
    assert received <= record.completion_tokens < 300


def test_full_queue_gets_429_with_retry_after(serve, card: ModelCard) -> None:
    server = serve(ServerConfig(max_waiting=1, retry_after_s=3))
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)

    def long_stream():
        return client.chat.completions.create(model=card.id, messages=HELLO, max_tokens=LONG,
                                              temperature=0, stream=True,
                                              extra_body={"drafter": "none"})

    running = long_stream()
    next(iter(running))
    waiting = long_stream()  # queued behind it
    assert jobs(server).in_flight == 2
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model=card.id, messages=HELLO, max_tokens=4)
    assert err.value.status_code == 429
    assert err.value.response.headers["retry-after"] == "3"
    assert err.value.body["code"] == "queue_full"
    running.close()
    waiting.close()
    wait_idle(server)
    ok = client.chat.completions.create(model=card.id, messages=HELLO, max_tokens=2,
                                        temperature=0)
    assert ok.usage.completion_tokens == 2  # room again once the engine ended both


def test_stopping_the_server_tells_each_client_its_request_was_cut(serve,
                                                                    card: ModelCard) -> None:
    """Stop (the app's Stop Server) while one reply streams, one is collected whole and one
    waits: each client gets a 503 saying the server is shutting down, at once, instead of
    a stream that just stops (read as a whole reply) or a dropped connection."""
    server = serve()
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=card.id, messages=HELLO, max_tokens=LONG,
                                            temperature=0, stream=True,
                                            extra_body={"drafter": "none"})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    errors: dict[str, openai.APIStatusError] = {}

    def whole(name: str) -> None:
        try:
            client.chat.completions.create(model=card.id, messages=HELLO, max_tokens=LONG,
                                           temperature=0)
        except openai.APIStatusError as e:
            errors[name] = e

    waiting = [threading.Thread(target=whole, args=(n,)) for n in ("first", "second")]
    for thread in waiting:
        thread.start()
    deadline = time.monotonic() + 30
    while jobs(server).in_flight < 3:
        assert time.monotonic() < deadline, "the two requests did not reach the queue"
        time.sleep(0.01)
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 2.9  # sooner than uvicorn's 3 s grace for streams
    with pytest.raises(openai.APIError, match=r"the server is shutting down: the reply was "
                       r"cut short after \d+ tokens; retry once it is back"):
        for _chunk in chunks:
            pass
    for thread in waiting:
        thread.join(30)
    assert sorted(errors) == ["first", "second"]
    for e in errors.values():  # both queued behind the stream, never started
        assert e.status_code == 503
        assert e.body["code"] == "server_shutting_down"
        assert e.body["message"] == "the server is shutting down; retry once it is back"
    wait_idle(server)


# ---------------------------------------------------------------------------- API key


def test_api_key_required_and_compared(serve, card: ModelCard,
                                       caplog: pytest.LogCaptureFixture) -> None:
    server = serve(ServerConfig(api_key="sekret-key"))
    wrong = openai.OpenAI(base_url=server.url, api_key="guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.models.list()
    assert "sekret-key" not in str(err.value)
    status, body = raw(server, "GET", "/v1/models", None, {})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    right = openai.OpenAI(base_url=server.url, api_key="sekret-key", max_retries=0)
    assert right.chat.completions.create(model=card.id, messages=HELLO, max_tokens=2,
                                         temperature=0).usage.completion_tokens == 2
    assert "sekret-key" not in caplog.text


def cors_headers(server: BackgroundServer, method: str, origin: str,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, str]]:
    url = urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request(method, "/v1/chat/completions", headers={"Origin": origin, **(headers or {})})
        response = conn.getresponse()
        response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_browser_pages_may_call_only_when_their_origin_is_allowed(serve, card: ModelCard
                                                                  ) -> None:
    """--allow-origin (CORS): a browser's preflight from an allowed page passes without the
    key (browsers send none there), its POST is answered with the header that lets the page
    read it; other pages, and every page by default, get no such header."""
    page = "http://localhost:3000"
    server = serve(ServerConfig(api_key="k", allow_origins=(page,)))
    status, headers = cors_headers(server, "OPTIONS", page, PREFLIGHT)
    assert status == 200 and headers["access-control-allow-origin"] == page
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    status, headers = cors_headers(server, "OPTIONS", "http://evil.example", PREFLIGHT)
    assert status == 400 and "access-control-allow-origin" not in headers
    url = urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    body = json.dumps({"model": card.id, "messages": HELLO, "max_tokens": 2,
                       "temperature": 0})
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Origin": page, "Authorization": "Bearer k",
                          "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("access-control-allow-origin") == page
    assert json.loads(response.read())["usage"]["completion_tokens"] == 2
    conn.close()
    default = serve()  # the control: no origin is allowed unless named
    status, headers = cors_headers(default, "OPTIONS", page, PREFLIGHT)
    assert "access-control-allow-origin" not in headers


def test_allow_origin_values_are_checked() -> None:
    from app.server.run import check_origins

    assert check_origins(["http://LocalHost:3000/", "*", "https://app.example"]) == (
        "http://localhost:3000", "*", "https://app.example")
    for bad in ("localhost:3000", "http://x.example/chat", "ftp://x.example", "http://"):
        with pytest.raises(EngineError, match=re.escape(f"--allow-origin: {bad!r}")):
            check_origins([bad])


def test_off_loopback_needs_a_key(capsys: pytest.CaptureFixture[str]) -> None:
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("localhost", None)
    check_bind("0.0.0.0", "k")
    with pytest.raises(EngineError, match="--api-key"):
        check_bind("0.0.0.0", None)
    with pytest.raises(EngineError, match="--api-key"):
        check_bind("192.168.1.5", "")
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: host 0.0.0.0") and "--api-key" in err


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_serve_port_out_of_range_is_an_argument_error(port: str,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    assert main(["serve", "--port", port]) == 1
    assert capsys.readouterr().err == f"error: --port must be 0-65535, got {port}\n"


def test_serve_command_serves_then_stops_cleanly_on_ctrl_c(engine) -> None:
    """`understudy serve` as a user runs it: prints the address, logs each request (never the
    key), and Ctrl-C ends it with status 0 (MLX's thread-local buffers freed on its thread)."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--model", engine.spec.model, "--port", "0",
         "--drafter", "none", "--api-key", "sekret-key"],
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if (found := re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)):
                break
        assert found, "".join(lines)
        client = openai.OpenAI(base_url=found.group(1), api_key="sekret-key", max_retries=0)
        reply = client.chat.completions.create(model="target", messages=HELLO, max_tokens=3,
                                               temperature=0)
        assert reply.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="target", messages=HELLO, n=2)
        # Ctrl-C mid-stream: the client is told its reply was cut, not left with a stream
        # that merely stops (which the SDK takes for a whole reply)
        stream = client.chat.completions.create(model="target", messages=HELLO,
                                                max_tokens=LONG, temperature=0, stream=True)
        for i, _chunk in enumerate(stream):
            if i == 3:
                break
        proc.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError, match="the server is shutting down: the reply "
                           "was cut short after"):
            for _chunk in stream:
                pass
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    assert "chat target: " in out and "+ 3 tokens" in out
    # a refused request is logged with its status and reason, where its developer looks
    assert "chat: 400 n > 1 is not supported: ask for one choice per request\n" in out
    assert "terminate called" not in out and "sekret-key" not in "".join(lines) + out


# ---------------------------------------------------------------------------- bad input


def raw(server: BackgroundServer, method: str, path: str, body: bytes | None,
        headers: dict[str, str]) -> tuple[int, dict]:
    url = urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _chat(**fields) -> bytes:
    body = {"model": "MODEL", "messages": HELLO, "max_tokens": 2, **fields}
    return json.dumps(body).encode()


BAD_INPUT = [
    # (name, path, body, status, code or param to find in the error)
    ("malformed JSON", "/v1/chat/completions", b'{"model": ', 400, None),
    ("invalid UTF-8", "/v1/chat/completions",
     b'{"model": "MODEL", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    # valid JSON syntax, but half a UTF-16 pair is no character: the tokenizer cannot take it
    ("unpaired surrogate", "/v1/chat/completions",
     b'{"model": "MODEL", "messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
     None),
    ("unpaired surrogate, completion", "/v1/completions",
     b'{"model": "MODEL", "prompt": "\\udfff"}', 400, None),
    ("max_tokens wrong type", "/v1/chat/completions", _chat(max_tokens="ten"), 422,
     "max_tokens"),
    ("max_tokens bool", "/v1/chat/completions", _chat(max_tokens=True), 422, "max_tokens"),
    ("messages not a list", "/v1/chat/completions", _chat(messages="hi"), 422, "messages"),
    ("messages empty", "/v1/chat/completions", _chat(messages=[]), 422, "messages"),
    ("content wrong type", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": 5}]), 422, "messages.0.content"),
    ("unknown role", "/v1/chat/completions",
     _chat(messages=[{"role": "wizard", "content": "hi"}]), 422, "messages.0.role"),
    ("negative max_tokens", "/v1/chat/completions", _chat(max_tokens=-5), 422, "max_tokens"),
    ("huge max_tokens", "/v1/chat/completions", _chat(max_tokens=10**9), 400, "max_tokens"),
    ("temperature too high", "/v1/chat/completions", _chat(temperature=3.5), 422,
     "temperature"),
    ("temperature negative", "/v1/chat/completions", _chat(temperature=-0.1), 422,
     "temperature"),
    ("top_p zero", "/v1/chat/completions", _chat(top_p=0), 422, "top_p"),
    ("seed below int64", "/v1/chat/completions", _chat(seed=-(2**63) - 1), 422, "seed"),
    ("stream not bool", "/v1/chat/completions", _chat(stream="yes"), 422, "stream"),
    ("too many stops", "/v1/chat/completions", _chat(stop=["a", "b", "c", "d", "e"]), 422,
     "stop"),
    ("empty stop", "/v1/chat/completions", _chat(stop=""), 422, "stop"),
    ("unknown drafter", "/v1/chat/completions", _chat(drafter="oracle"), 422, "drafter"),
    ("draft_k beyond K_MAX", "/v1/chat/completions", _chat(draft_k=99), 422, "draft_k"),
    ("draft_k not an int", "/v1/chat/completions", _chat(draft_k="4"), 422, "draft_k"),
    ("top_k negative", "/v1/chat/completions", _chat(top_k=-1), 422, "top_k"),
    ("prediction not an object", "/v1/chat/completions", _chat(prediction="def f"), 422,
     "prediction"),
    ("prediction of another type", "/v1/chat/completions",
     _chat(prediction={"type": "image", "content": "x"}), 422, "prediction.type"),
    ("prediction content not text", "/v1/chat/completions",
     _chat(prediction={"type": "content", "content": 7}), 422, "prediction.content"),
    ("top_k not an int", "/v1/chat/completions", _chat(top_k=2.5), 422, "top_k"),
    ("min_p above 1", "/v1/chat/completions", _chat(min_p=1.5), 422, "min_p"),
    ("repetition_penalty zero", "/v1/chat/completions", _chat(repetition_penalty=0), 422,
     "repetition_penalty"),
    ("repeat_penalty negative", "/v1/chat/completions", _chat(repeat_penalty=-1.1), 422,
     "repeat_penalty"),
    ("both penalty names, different values", "/v1/chat/completions",
     _chat(repetition_penalty=1.1, repeat_penalty=1.3), 422, "repeat_penalty"),
    ("tools refused", "/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("n > 1 refused", "/v1/chat/completions", _chat(n=2), 400, "n"),
    ("continuing a user message", "/v1/chat/completions",
     _chat(continue_final_message=True), 400, "continue_final_message"),
    ("logprobs refused", "/v1/chat/completions", _chat(logprobs=True), 400, "logprobs"),
    ("JSON mode refused", "/v1/chat/completions",
     _chat(response_format={"type": "json_object"}), 400, "response_format"),
    ("structured output refused", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     "response_format"),
    ("image part refused", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [
         {"type": "text", "text": "what is this?"},
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), 400,
     "messages.0.content"),
    ("several prompts", "/v1/completions",
     b'{"model": "MODEL", "prompt": ["a", "b"]}', 400, "prompt"),
    ("empty prompt list", "/v1/completions", b'{"model": "MODEL", "prompt": []}', 422,
     "prompt"),
    ("unknown model", "/v1/chat/completions", _chat(model="gpt-9"), 404, "model"),
    ("prompt longer than context", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "hello " * 2100}]), 400, "messages"),
    ("body over the limit", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "x" * 70_000}]), 413, None),
    ("token id outside the vocabulary", "/v1/completions",
     b'{"model": "MODEL", "prompt": [1, 2, 1000000000]}', 400, "prompt"),
    ("negative token id", "/v1/completions", b'{"model": "MODEL", "prompt": [[1, -2]]}', 400,
     "prompt"),
    ("two token-id prompts", "/v1/completions", b'{"model": "MODEL", "prompt": [[1], [2]]}',
     400, "prompt"),
    ("empty token-id prompt", "/v1/completions", b'{"model": "MODEL", "prompt": [[]]}', 400,
     "prompt"),
    ("completion prompt wrong type", "/v1/completions",
     b'{"model": "MODEL", "prompt": 5}', 422, "prompt"),
    ("completion prompt too long", "/v1/completions",
     json.dumps({"model": "MODEL", "prompt": "hello " * 2100}).encode(), 400, "prompt"),
    ("unknown path", "/v1/embeddings", b"{}", 404, None),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), BAD_INPUT,
                         ids=[row[0] for row in BAD_INPUT])
def test_bad_input_gets_an_error_object(serve, card: ModelCard, name: str, path: str,
                                        body: bytes, status: int, param: str | None) -> None:
    server = _limited_server(serve)
    n_records = len(jobs(server).records)
    body = body.replace(b"MODEL", card.id.encode())
    got, reply = raw(server, "POST", path, body, {"Content-Type": "application/json"})
    assert got == status, reply
    error = reply["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    assert len(jobs(server).records) == n_records  # nothing reached the engine
    assert jobs(server).in_flight == 0
    # and the server keeps serving
    ok, good = raw(server, "POST", "/v1/chat/completions",
                   _chat(model=card.id, max_tokens=1, temperature=0),
                   {"Content-Type": "application/json"})
    assert ok == 200 and good["usage"]["completion_tokens"] == 1


ERROR_MESSAGES = [
    # (name, path, body, status, the message) for errors whose cause a client must read
    ("several prompts", "/v1/completions", b'{"model": "MODEL", "prompt": ["a", "b"]}', 400,
     "prompt: only one prompt per request is supported, got 2: send one request per prompt"),
    ("token id outside the vocabulary", "/v1/completions",
     b'{"model": "MODEL", "prompt": [1, 2, 1000000000]}', 400,
     "prompt: token id 1000000000 is not in this model's vocabulary (0-VOCAB)"),
    ("five stops, completion", "/v1/completions",
     b'{"model": "MODEL", "prompt": "a", "stop": ["a","b","c","d","e"]}', 422,
     "stop: at most 4 stop strings are supported, got 5"),
    ("five stops, chat", "/v1/chat/completions", _chat(stop=["a", "b", "c", "d", "e"]), 422,
     "stop: at most 4 stop strings are supported, got 5"),
    ("a stop not a string", "/v1/chat/completions", _chat(stop=["a", 5]), 422,
     "stop.1: Input should be a valid string"),
    ("image part", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages.0.content: only text parts are supported, got a part of type 'image_url'"),
    ("text part without text", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 422,
     "messages.0.content.0.text: Field required"),
    ("a tool result", "/v1/chat/completions",
     _chat(messages=[*HELLO, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]),
     400, "messages.1.role: 'tool' messages (tool results) are not supported: this server "
     "does not call tools"),
    ("JSON mode", "/v1/chat/completions", _chat(response_format={"type": "json_object"}), 400,
     "response_format (JSON mode, structured outputs) is not supported by this server: "
     "replies are plain text"),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "message"), ERROR_MESSAGES,
                         ids=[row[0] for row in ERROR_MESSAGES])
def test_error_messages_name_the_cause(serve, card: ModelCard, name: str, path: str,
                                       body: bytes, status: int, message: str) -> None:
    server = _limited_server(serve)
    body = body.replace(b"MODEL", card.id.encode())
    got, reply = raw(server, "POST", path, body, {"Content-Type": "application/json"})
    message = message.replace("VOCAB", str(card.tokenizer.vocab_size - 1))
    assert (got, reply["error"]["message"]) == (status, message)


def test_an_emoji_as_a_surrogate_pair_escape_is_one_character(client: openai.OpenAI,
                                                              card: ModelCard) -> None:
    """ensure_ascii JSON (Python's default) spells 😀 as "\\ud83d\\ude00": a whole pair is
    a character, not the unpaired half refused above."""
    server_url = urlsplit(str(client.base_url))
    conn = http.client.HTTPConnection(server_url.hostname, server_url.port, timeout=60)
    body = json.dumps({"model": card.id, "max_tokens": 1,
                       "messages": [{"role": "user", "content": "smile 😀"}]})
    assert "\\ud83d\\ude00" in body
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    ids = card.tokenizer.encode_chat([{"role": "user", "content": "smile 😀"}])
    assert json.loads(response.read())["usage"]["prompt_tokens"] == len(ids)


class _BrokenBackend:
    """A backend with a bug: it cannot even list its models."""

    def models(self) -> list[ModelCard]:
        raise RuntimeError("the model list is broken")

    def submit(self, job) -> None:
        raise AssertionError("nothing should reach the engine")


def test_a_server_bug_still_answers_an_error_object() -> None:
    """Starlette's own answer to an exception is a plain-text "Internal Server Error" that an
    OpenAI client can only show as a bare status; ours is an error object naming the cause."""
    server = BackgroundServer(create_app(_BrokenBackend()), port=0)
    server.start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            client.models.list()
    finally:
        server.stop()
    assert err.value.status_code == 500
    assert err.value.body["code"] == "internal_error"
    assert err.value.body["message"] == "internal error (RuntimeError): the model list is broken"


def test_a_base_url_without_v1_is_named_as_the_cause(client: openai.OpenAI,
                                                    server: BackgroundServer,
                                                    card: ModelCard) -> None:
    """The usual slip: base_url "http://host:port" without /v1. The SDK shows the message,
    so it says what to set, not only "Not Found"."""
    root = server.url.removesuffix("/v1")
    slipped = openai.OpenAI(base_url=root, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        slipped.chat.completions.create(model=card.id, messages=HELLO, max_tokens=1)
    assert err.value.body["message"] == (
        "there is no /chat/completions here; this server answers POST /v1/chat/completions, "
        "POST /v1/completions, GET /v1/models: is the client's base URL missing /v1? It "
        f"should be {server.url}")
    with pytest.raises(openai.NotFoundError, match=f"It should be {server.url}"):
        slipped.models.list()
    status, body = raw(server, "POST", "/v1/embeddings", b"{}", {})
    assert status == 404 and body["error"]["message"].startswith(
        "there is no /v1/embeddings here; this server answers POST /v1/chat/completions")
    assert "missing /v1" not in body["error"]["message"]
    status, body = raw(server, "GET", "/v1/chat/completions", None, {})
    assert (status, body["error"]["message"]) == (
        405, "/v1/chat/completions takes POST requests, not GET")


def test_a_plain_text_response_format_is_accepted(client: openai.OpenAI,
                                                  card: ModelCard) -> None:
    """{"type": "text"} asks for what every reply here is: no reason to refuse it."""
    reply = client.chat.completions.create(model=card.id, messages=HELLO, max_tokens=3,
                                           temperature=0, response_format={"type": "text"})
    assert reply.usage.completion_tokens == 3


def test_a_drafter_the_model_lacks_says_why(serve, card: ModelCard) -> None:
    """No head is trained for the served model: the error says how to get one."""
    server = _limited_server(serve)
    got, reply = raw(server, "POST", "/v1/chat/completions",
                     _chat(model=card.id, drafter="head"), {"Content-Type": "application/json"})
    assert got == 400 and reply["error"]["param"] == "drafter"
    assert f"understudy train-drafter --model {card.id}" in reply["error"]["message"]
    assert "available: none, auto, " in reply["error"]["message"]


_LIMITED: dict[str, BackgroundServer] = {}


def _limited_server(serve) -> BackgroundServer:
    """One app for the whole table, with a 64 KiB body limit so the 413 row stays small."""
    if "server" not in _LIMITED:
        _LIMITED["server"] = serve(ServerConfig(max_body_bytes=64 * 1024))
    return _LIMITED["server"]


def test_tokenizer_off_the_engine_thread_matches(card: ModelCard, engine) -> None:
    """The server encodes prompts with the card's tokenizer, a copy of the model folder's."""
    folder = Path(engine.spec.model)
    assert card.tokenizer.encode_chat(HELLO) == Tokenizer.from_folder(folder).encode_chat(HELLO)


def test_concurrent_requests_keep_their_own_tokens(client: openai.OpenAI,
                                                   card: ModelCard) -> None:
    """Four clients at once on tiny models: each streamed text equals that request alone."""
    prompts = [f"Say {word}" for word in ("one", "two", "three", "four")]
    alone = {p: client.chat.completions.create(
        model=card.id, messages=[{"role": "user", "content": p}], max_tokens=10,
        temperature=0.7, seed=5).choices[0].message.content for p in prompts}
    got: dict[str, str] = {}

    def run(p: str) -> None:
        got[p], _, tokens = stream_text(client.chat.completions.create(
            model=card.id, messages=[{"role": "user", "content": p}], max_tokens=10,
            temperature=0.7, seed=5, stream=True))
        assert "".join(tokens) == got[p]

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == alone


def test_a_trained_head_is_served_and_auto_may_use_it(tmp_path: Path) -> None:
    """`understudy serve` carries the target's trained head, as the app and the CLI do: the
    model card lists `head` and a request naming it drafts with it, losslessly. The same
    target without a head (the negative control) neither lists nor accepts it."""
    import shutil

    from engine.drafters.head_io import head_root, publish_checkpoint, write_head
    from engine.loading import load_model
    from tests.engine.test_head import random_head
    from tests.fixtures.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "headed", num_hidden_layers=4, seed=7)
    target = load_model(str(folder))
    root = head_root(target.path)

    def serve_once(drafter: str) -> tuple[ModelCard, list[tuple[str, dict]]]:
        engine = EngineThread(EngineSpec(str(folder), None, "auto"))
        card = engine.start()
        server = BackgroundServer(create_app(engine), port=0)
        server.start()
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        try:
            out = []
            for name in ("none", drafter):
                reply = client.chat.completions.create(
                    model=card.id, messages=HELLO, max_tokens=24, seed=1,
                    extra_body={"drafter": name, "draft_k": 2})
                out.append((reply.choices[0].message.content, ext(reply)))
            return card, out
        finally:
            server.stop()
            engine.close()

    with pytest.raises(openai.APIStatusError) as refused:
        serve_once("head")
    assert "head" in str(refused.value) and refused.value.status_code < 500
    write_head(random_head(target, n_hot=200), tmp_path / "staged", {"steps": 1})
    publish_checkpoint(root, tmp_path / "staged", "ckpt-0000001")
    try:
        card, [(plain, _), (text, stats)] = serve_once("head")
        assert "head" in card.drafters
        assert stats["drafted"] > 0 and stats["steps_by_drafter"].get("head")
        assert text == plain
    finally:
        shutil.rmtree(root)


def test_a_model_without_chat_template_is_said_once(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """`serve` printed it twice: the app's warning line, then the same as a log record."""
    import json

    from engine.tokenizer import ChatTemplateWarning
    from tests.fixtures.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "plain")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    engine = EngineThread(EngineSpec(str(folder), None, "auto"))
    try:
        with pytest.warns(ChatTemplateWarning, match="has no chat template"):
            engine.start()
    finally:
        engine.close()
    assert [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()] == []
