"""A conversation longer than the context window keeps working: its oldest exchanges are
left out of the prompt (`engine.context_fit`), in steps that keep the cached prefix.

A tiny random model whose config.json gives it a 512-token window, its real tokenizer and
chat template, through `ChatSession` as the app and `understudy chat` use it.
"""

from __future__ import annotations

import json

import pytest

from engine.context_fit import dropped_note, fit_to_window, reply_room
from engine.decode import ChatSession, GenerateOptions
from engine.errors import PromptError
from engine.events import Finished
from engine.loading import LoadedModel, load_model
from tests.fixtures.tiny_models import write_tiny_model

WINDOW = 512
SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture(scope="module")
def small_window(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = write_tiny_model(tmp_path_factory.mktemp("window") / "tiny")
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = WINDOW
    (folder / "config.json").write_text(json.dumps(config))
    return load_model(str(folder))


def exchange(i: int, words: int = 2) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question {i}: " + "tell me more " * words},
            {"role": "assistant", "content": f"answer {i}: " + "here is more " * words}]


def conversation(n: int) -> list[dict[str, str]]:
    """SYSTEM, n exchanges, and a last user message: ~75 tokens an exchange."""
    turns = [m for i in range(n) for m in exchange(i)]
    return [SYSTEM, *turns, {"role": "user", "content": f"question {n}: and now?"}]


def reply(session: ChatSession, messages: list[dict], max_tokens: int = 16) -> Finished:
    events = list(session.generate(messages, GenerateOptions(max_tokens=max_tokens)))
    assert isinstance(events[-1], Finished)
    return events[-1]


def test_a_conversation_that_fits_is_read_whole(small_window: LoadedModel) -> None:
    encode = ChatSession(small_window).encode
    messages = conversation(2)
    fitted = fit_to_window(messages, encode, WINDOW, 64)
    assert fitted.dropped == 0 and fitted.ids == encode(messages)


def test_a_prompt_is_measured_as_it_is_encoded(small_window: LoadedModel) -> None:
    """`prompt_length` is what the cut is worked out from: it must be the encoded length,
    and refuse what `encode` refuses in the same words."""
    session = ChatSession(small_window)
    for messages in (conversation(2), conversation(12)):
        for continue_final in (False, True):
            assert session.prompt_length(messages, continue_final) == len(
                session.encode(messages, continue_final))
    for bad in ([], [{"role": "user", "content": "  "}]):
        with pytest.raises(PromptError) as encoding:
            session.encode(bad)
        with pytest.raises(PromptError) as measuring:
            session.prompt_length(bad)
        assert str(measuring.value) == str(encoding.value)


def test_the_oldest_exchanges_go_in_steps_of_a_quarter_window(
        small_window: LoadedModel) -> None:
    encode = ChatSession(small_window).encode
    room = reply_room(WINDOW, 64)
    messages = conversation(12)
    whole = len(encode(messages))
    assert whole + room > WINDOW  # must be cut
    fitted = fit_to_window(messages, encode, WINDOW, room)
    kept = [messages[0], *messages[1 + fitted.dropped:]]
    assert fitted.ids == encode(kept)
    assert kept[0] == SYSTEM and kept[1]["role"] == "user"  # the system prompt stays
    assert fitted.dropped % 2 == 0 and fitted.dropped > 0  # whole exchanges
    # at least what had to go, rounded up to a quarter window: room for the next turns
    need = whole + room - WINDOW
    assert whole - len(fitted.ids) >= -(-need // (WINDOW // 4)) * (WINDOW // 4)
    # ... and no more than one exchange beyond that
    one_less = encode([messages[0], *messages[1 + fitted.dropped - 2:]])
    assert whole - len(one_less) < -(-need // (WINDOW // 4)) * (WINDOW // 4)

    # as the chat grows exchange by exchange, the cut moves about every other exchange (a
    # quarter window is ~1.7 exchanges here): in between, the cached prefix stays valid
    growing = [conversation(12 + n) for n in range(8)]
    cuts = [fit_to_window(m, encode, WINDOW, room).dropped for m in growing]
    moves = sum(a != b for a, b in zip(cuts, cuts[1:], strict=False))
    assert cuts == sorted(cuts) and moves <= 4
    # negative control: a cut just big enough for each turn moves with every exchange
    tight = [fit_to_window(m, encode, WINDOW, room, step=1).dropped for m in growing]
    assert sum(a != b for a, b in zip(tight, tight[1:], strict=False)) == 7


def test_a_last_message_longer_than_the_window_is_one_clear_error(
        small_window: LoadedModel) -> None:
    session = ChatSession(small_window)
    huge = [SYSTEM, *exchange(0), {"role": "user", "content": "a" * 2 * WINDOW}]
    with pytest.raises(PromptError, match=r"last message is \d+ tokens .*window.* is 512"):
        session.generate(huge)
    # a last message that fits the window, if not with the whole reply room, still runs
    near = [{"role": "user", "content": "a" * (WINDOW - 40)}]
    assert len(session.encode(near)) + 64 > WINDOW
    assert reply(session, near, max_tokens=64).stats.generated_tokens > 0


def test_a_long_chat_goes_on_reusing_its_cache_and_texts_match_speculation(
        small_window: LoadedModel) -> None:
    """Turn after turn past the window: every reply runs, says how many messages it left
    out, and computes only the new tokens while the cut stays; plain and speculative
    decoding read the same prompt, so they write the same text."""
    plain, spec = ChatSession(small_window), ChatSession(small_window)
    messages = conversation(4)
    seen = []
    for turn in range(8):
        a = reply(plain, messages)
        b = list(spec.generate(messages, GenerateOptions(max_tokens=16, drafter="ngram")))[-1]
        assert isinstance(b, Finished) and b.text == a.text
        s = a.stats
        assert s.prompt_tokens + reply_room(WINDOW, 16) <= WINDOW
        seen.append((s.dropped_messages, s.prompt_tokens, s.prefilled_tokens))
        messages += [{"role": "assistant", "content": a.text}, *exchange(100 + turn)[:1]]
    dropped = [d for d, _, _ in seen]
    assert dropped[0] == 0 and dropped[-1] > 0 and dropped == sorted(dropped)
    # a turn whose cut did not move computed only what is new since the last one
    kept_cut = [(p, n) for (d0, _, _), (d, p, n) in zip(seen, seen[1:], strict=False)
                if d == d0 > 0]
    assert kept_cut and all(n < p / 2 for p, n in kept_cut)


def test_the_note_names_how_many_messages(small_window: LoadedModel) -> None:
    assert dropped_note(0) == ""
    assert dropped_note(1) == "1 earliest message left out to fit the context window"
    assert dropped_note(6).startswith("6 earliest messages")
