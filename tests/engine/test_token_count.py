"""TokenCounter: a text's token count from its pieces' kept counts equals tokenizing it
whole, for byte-level and SentencePiece-style tokenizers, and tokenizes only new pieces."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from engine.token_count import TokenCounter, cut_tokens
from tests.fixtures.tiny_models import tokenizer_json

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
# what a rendered chat is made of, with the near misses that must not be cut at
FRAGMENTS = [*SPECIALS, "<|turn|>", "<|im_", "_start|>", "<", "|>", "<s", "s>", " ", "  ", "\n", "\n\n",
             "\t", "user", "assistant", "Hello", " world", "def f(x):", "12345", "é", "日本語",
             "🙂", "▁", "Ġ", "  indented", "x" * 40]


def sentencepiece_like(prepend_scheme: str) -> HFTokenizer:
    """A Metaspace tokenizer (Llama 2, Mistral, Gemma style): with the "first" scheme only
    the stretch at the very start of a text gets the word-start mark."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *SPECIALS],
                                  show_progress=False)
    tok.train_from_iterator(["Hello world, the user and the assistant write code."] * 20
                            + ["def f(x): return x + 1", "日本語 é 🙂 12345"] * 5, trainer)
    return tok


def byte_level() -> HFTokenizer:
    tok = HFTokenizer.from_str(tokenizer_json())  # the tiny models' ChatML tokenizer
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def with_stripping_token() -> HFTokenizer:
    """An added token that eats the spaces before it looks across a cut at it."""
    tok = byte_level()
    tok.add_special_tokens([AddedToken("<|turn|>", special=True, normalized=False,
                                       lstrip=True)])
    return tok


MAKERS: dict[str, Callable[[], HFTokenizer]] = {
    "byte-level": byte_level,
    "metaspace-first": lambda: sentencepiece_like("first"),
    "metaspace-always": lambda: sentencepiece_like("always"),
    "lstrip": with_stripping_token,
}


@pytest.fixture(scope="module", params=list(MAKERS))
def hf(request: pytest.FixtureRequest) -> HFTokenizer:
    return MAKERS[request.param]()


@pytest.fixture(scope="module")
def counter(hf: HFTokenizer) -> TokenCounter:
    """One counter per tokenizer for every example: later texts reuse earlier pieces."""
    return TokenCounter(lambda text: hf.encode(text, add_special_tokens=False).ids,
                        cut_tokens(hf), max_chars=2_000)


def whole(hf: HFTokenizer, text: str) -> tuple[int, int | None]:
    ids = hf.encode(text, add_special_tokens=False).ids
    return len(ids), (ids[0] if ids else None)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=30))
def test_counted_by_pieces_is_counted_whole(hf: HFTokenizer, counter: TokenCounter,
                                            parts: list[str]) -> None:
    text = "".join(parts)
    assert counter.count(text) == whole(hf, text)
    assert counter.count(text) == whole(hf, text)  # from the kept counts, the same


def test_only_tokenizers_whose_pieces_add_up_are_cut() -> None:
    assert set(SPECIALS) <= set(cut_tokens(byte_level()) or [])
    assert cut_tokens(with_stripping_token()) is None
    truncating = byte_level()
    truncating.enable_truncation(8)
    assert cut_tokens(truncating) is None


def test_a_text_seen_before_is_not_tokenized_again() -> None:
    hf = byte_level()
    seen: list[str] = []

    def tokenize(text: str) -> list[int]:
        seen.append(text)
        return hf.encode(text, add_special_tokens=False).ids

    counter = TokenCounter(tokenize, cut_tokens(hf))
    turns = "".join(f"<|im_start|>user\nquestion {i}<|im_end|>\n<|im_start|>assistant\n"
                    f"answer {i} " + "more " * 50 + "<|im_end|>\n" for i in range(100))
    assert counter.count(turns) == whole(hf, turns)
    assert sum(map(len, seen)) == len(turns)  # each piece once
    seen.clear()
    longer = turns + "<|im_start|>user\nand now?<|im_end|>\n"
    assert counter.count(longer) == whole(hf, longer)
    assert seen == ["<|im_start|>user\nand now?"]  # "<|im_end|>\n" was seen before
    # a bounded memory: past `max_chars` the oldest pieces are tokenized again
    small = TokenCounter(tokenize, cut_tokens(hf), max_chars=100)
    small.count(turns)
    seen.clear()
    assert small.count(turns) == whole(hf, turns) and len(seen) > 100


def test_demo_counts_match(demo_model_dir: Path) -> None:
    hf = HFTokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    assert {"<|im_start|>", "<|im_end|>"} <= set(cut_tokens(hf) or [])
    counter = TokenCounter(lambda t: hf.encode(t, add_special_tokens=False).ids, cut_tokens(hf))
    text = "".join(f"<|im_start|>user\n{f} 2024 ünïcode<|im_end|>\n" for f in FRAGMENTS)
    assert counter.count(text) == whole(hf, text)
