"""`fit_to_window` measuring with a counter gives what it gave when it encoded the whole
conversation every turn (kept below as the reference), for any encoder and for the real
templates and tokenizers; and a long chat's turn encodes its window, not its history."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from engine.context_fit import FittedPrompt, fit_to_window
from engine.errors import PromptError
from engine.token_count import TokenCounter, cut_tokens
from engine.tokenizer import Tokenizer
from tests.fixtures.tiny_models import write_tokenizer

Encode = Callable[[Sequence[dict]], list[int]]


def reference_fit(messages: Sequence[dict], encode: Encode, window: int, room: int,
                  step: int | None = None) -> FittedPrompt:
    """`fit_to_window` as it was before it took a counter: the whole conversation and every
    cut it tried encoded."""
    ids = encode(messages)
    need = len(ids) + room - window
    if need <= 0:
        return FittedPrompt(ids, tuple(messages))
    pinned = 1 if messages and messages[0].get("role") == "system" else 0
    starts = [i for i in range(pinned, len(messages)) if messages[i].get("role") == "user"]
    starts = starts or [len(messages) - 1]

    def kept(j: int) -> tuple[dict, ...]:
        return (*messages[:pinned], *messages[starts[j]:])

    def cut_at(j: int) -> list[int]:
        return encode(kept(j))

    step = max(1, window // 4 if step is None else step)
    for wanted in (-(-need // step) * step, need):
        lo, hi, best = 0, len(starts) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            kept_ids = cut_at(mid)
            if len(ids) - len(kept_ids) >= wanted:
                best, hi = (mid, kept_ids), mid - 1
            else:
                lo = mid + 1
        if best is not None:
            j, kept_ids = best
            return FittedPrompt(kept_ids, kept(j), starts[j] - pinned)
    j = len(starts) - 1
    last = cut_at(j) if starts[j] > pinned else ids
    if len(last) < window:
        return FittedPrompt(last, kept(j), starts[j] - pinned)
    raise PromptError(
        f"the last message is {len(last)} tokens long with the chat template"
        f"{' and the system prompt' if pinned else ''}, but the model's context window "
        f"(config.json max_position_embeddings) is {window}: shorten it or split it over "
        "several messages")


def outcome(fit: Callable[[], FittedPrompt]) -> Any:
    """What a fit returns, or the error it raises, in a form that compares."""
    try:
        return fit()
    except Exception as e:  # noqa: BLE001 - the error is part of the result compared
        return type(e), str(e)


# ------------------------------------------------------------------------ any encoder

ROLES = st.sampled_from(["system", "user", "assistant", "developer"])
CONVERSATIONS = st.lists(st.fixed_dictionaries({"role": ROLES, "content": st.text(max_size=12)}),
                         max_size=25)


@settings(max_examples=500, deadline=None)
@given(messages=CONVERSATIONS, share=st.floats(0.05, 1.2), room=st.integers(1, 80),
       step=st.none() | st.integers(1, 30),
       extra=st.lists(st.integers(0, 20), min_size=1, max_size=4))
def test_any_encoder_gives_the_reference_result(messages: list[dict], share: float, room: int,
                                                step: int | None, extra: list[int]) -> None:
    """Lengths neither additive nor monotone in the messages kept (a header whose length
    depends on how many there are): the cut is the reference's, with or without a counter,
    since both measure every cut the reference measured."""
    def encode(m: Sequence[dict]) -> list[int]:
        return [len(x["content"]) for x in m for _ in range(1 + len(x["content"]))] \
            + [7] * extra[len(m) % len(extra)]

    window = max(1, int(len(encode(messages)) * share))  # mostly too small for it all
    want = outcome(lambda: reference_fit(messages, encode, window, room, step))
    assert outcome(lambda: fit_to_window(messages, encode, window, room, step)) == want
    assert outcome(lambda: fit_to_window(messages, encode, window, room, step,
                                         count=lambda m: len(encode(m)))) == want


# --------------------------------------------------------- real templates and tokenizers

CHAT_TEXT = st.lists(st.sampled_from(
    ["hello", " world", "\n", "  ", "def f(x):\n    return x", "12 345", "é日本🙂",
     "<|im_start|>", "<|im_end|>", "<|im_", "more " * 30]), max_size=8).map("".join)
CHATS = st.lists(st.fixed_dictionaries({"role": ROLES, "content": CHAT_TEXT}), min_size=1,
                 max_size=30)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tokenizer(folder)
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(demo_model_dir)


@pytest.fixture(scope="module", params=["tiny", "demo"])
def chat_tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tokenizer")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=CHATS, share=st.floats(0.0, 1.2), room=st.integers(1, 100),
       continue_final=st.booleans(), roomy=st.sampled_from([False, True, True, True]))
def test_real_templates_give_the_reference_result(chat_tokenizer: Tokenizer,
                                                  messages: list[dict], share: float,
                                                  room: int, continue_final: bool,
                                                  roomy: bool) -> None:
    """The tiny models' ChatML and the demo's template (which adds a default system prompt
    where the conversation has none), counted by the tokenizer's `count_chat`, whose
    counts every example shares, as a chat's turns do."""
    tok = chat_tokenizer

    def encode(m: Sequence[dict]) -> list[int]:
        return tok.encode_chat(list(m), continue_final=continue_final)

    def count(m: Sequence[dict]) -> int:
        return tok.count_chat(list(m), continue_final=continue_final)

    pinned = 1 if messages[0]["role"] == "system" else 0
    users = [i for i in range(pinned, len(messages)) if messages[i]["role"] == "user"]
    whole = outcome(lambda: encode(messages))
    last = outcome(lambda: encode([*messages[:pinned], *messages[users[-1] if users else -1:]]))
    if not isinstance(whole, list) or not isinstance(last, list):
        whole = last = [0] * 100
    # mostly a window the last exchange and the reply's room fit in, and a share of the rest
    window = max(8, int(len(whole) * share) + (len(last) + room if roomy else 0))
    want = outcome(lambda: reference_fit(messages, encode, window, room))
    assert outcome(lambda: fit_to_window(messages, encode, window, room, count=count)) == want


# ------------------------------------------------------------------- what a turn costs

def long_chat(exchanges: int) -> list[dict[str, str]]:
    turns = [m for i in range(exchanges) for m in (
        {"role": "user", "content": f"question {i}: " + "tell me more " * (i % 7 + 1)},
        {"role": "assistant", "content": f"answer {i}: " + "here is more " * (i % 11 + 3)})]
    return [{"role": "system", "content": "You are terse."}, *turns,
            {"role": "user", "content": "and now?"}]


def test_a_long_chat_encodes_its_window_and_tokenizes_only_what_is_new(
        tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    window, room = 512, 128
    write_tokenizer(tmp_path)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tokenized: list[int] = []  # characters handed to the tokenizer, per call

    def tokenize(text: str) -> list[int]:
        tokenized.append(len(text))
        return hf.encode(text, add_special_tokens=False).ids

    counter = TokenCounter(tokenize, cut_tokens(hf))
    encoded: list[int] = []  # tokens of the messages each encode call was given

    def encode(m: Sequence[dict]) -> list[int]:
        ids = tiny_tokenizer.encode_chat(list(m))
        encoded.append(len(ids))
        return ids

    def count(m: Sequence[dict]) -> int:
        return counter.count(tiny_tokenizer.chat_text(list(m)))[0]

    messages = long_chat(400)
    whole = len(tiny_tokenizer.encode_chat(messages))
    assert whole > 50 * window
    # negative control: the reference encodes the whole chat and half of it, and so on
    reference_fit(messages, encode, window, room)
    assert sum(encoded) > 2 * whole
    for turn in range(3):
        encoded.clear()
        tokenized.clear()
        fitted = fit_to_window(messages, encode, window, room, count=count)
        assert fitted == reference_fit(
            messages, lambda m: tiny_tokenizer.encode_chat(list(m)), window, room)
        assert encoded == [len(fitted.ids)] and len(fitted.ids) < window  # the kept part
        new = len(tiny_tokenizer.chat_text(messages)) if turn == 0 else 200
        assert sum(tokenized) <= new  # the first turn, the chat once; then the new turn
        messages = [*messages, {"role": "assistant", "content": f"reply {turn}"},
                    {"role": "user", "content": f"follow-up {turn}"}]
