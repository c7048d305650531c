"""SentencePiece (`tokenizer.ggml.model = llama`) GGUF vocabularies: Llama 2, Mistral, TinyLlama.

Three references: transformers' own GGUF tokenizer converter, the trained SentencePiece model
itself, and llama.cpp's rule for text that follows an added token.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import sentencepiece
from tokenizers import Tokenizer as HFTokenizer

from engine.gguf import import_gguf
from engine.gguf_tokenizer import sentencepiece_merges
from engine.tokenizer import Tokenizer
from tests.engine.test_gguf import read_json, write_tiny_gguf
from tests.fixtures.gguf_files import spm_vocabulary

# Multilingual, code, and whitespace of every kind (runs of spaces, tabs, blank lines, a
# trailing space), plus characters the vocabulary lacks (emoji, rare CJK) for byte fallback.
TEXT = ("Größe über alles, ça va? Привет, мир!  你好，世界 🙂 こんにちは\n"
        "def fibonacci(n: int) -> int:\n    if n < 2:\n\t\treturn n  # 龘\n\n\n"
        "for (int i = 0; i < 10; ++i) {   printf(\"%d\\n\", i); }   \n"
        "The  quick\u00a0brown fox\u3000jumps")


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the GGUF file, its imported folder)."""
    root = tmp_path_factory.mktemp("spm")
    write_tiny_gguf(root / "llama2-style.gguf", spm=spm_vocabulary())
    return root / "llama2-style.gguf", import_gguf(root / "llama2-style.gguf", root / "out")


def transformers_tokenizer(src: Path) -> HFTokenizer:
    """transformers' GGUF converter (its file reader needs torch, so gguf reads the fields)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    fields = gguf.GGUFReader(src).fields
    tokenizer_dict = {name: fields[f"tokenizer.{key}"].contents()
                      for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
                      if f"tokenizer.{key}" in fields}
    backend, _ = convert_gguf_tokenizer("llama", tokenizer_dict)
    return backend


def sp_processor() -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_proto=spm_vocabulary().model_proto)


def test_tokenizes_like_transformers_and_sentencepiece(spm_model: tuple[Path, Path]) -> None:
    src, folder = spm_model
    ours = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    got = ours.encode(TEXT, add_special_tokens=False)
    want = transformers_tokenizer(src).encode(TEXT, add_special_tokens=False)
    assert got.tokens == want.tokens
    assert got.ids == want.ids
    # the model's own tokenizer agrees too, byte fallback included
    sp = sp_processor()
    assert got.ids == sp.encode(TEXT)
    assert {"<0xF0>", "<0x9F>", "<0x99>", "<0x82>", "▁▁", "<0x0A>"} <= set(got.tokens)
    assert ours.decode(got.ids) == TEXT


def test_leading_space_and_text_after_added_tokens_follow_llama_cpp(
        spm_model: tuple[Path, Path]) -> None:
    """Where transformers' converter differs from llama.cpp and SentencePiece, we follow them.

    llama.cpp (and the models' hub tokenizer.json) prefix every stretch of text that starts
    the prompt or follows an added token with one space, even when it already starts with
    one; transformers' converter prefixes only the very start, and never doubles a space.
    """
    src, folder = spm_model
    ours = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    theirs = transformers_tokenizer(src)
    sp = sp_processor()
    lead = " leading space"
    assert ours.encode(lead, add_special_tokens=False).ids == sp.encode(lead)  # "▁▁" first
    assert theirs.encode(lead, add_special_tokens=False).ids != sp.encode(lead)
    prompt = "</s><s>[INST] hi [/INST]<|user|>next"
    got = ours.encode(prompt, add_special_tokens=False)
    assert got.ids == [2, 1, *sp.encode("[INST] hi [/INST]"), 3, *sp.encode("next")]
    assert got.tokens[2] == "▁"
    assert theirs.encode(prompt, add_special_tokens=False).tokens[2] != "▁"


def test_special_tokens_bos_and_stop_ids_come_from_metadata(spm_model: tuple[Path, Path]
                                                           ) -> None:
    _, folder = spm_model
    tok_config = read_json(folder, "tokenizer_config.json")
    assert {k: tok_config[k] for k in ("bos_token", "eos_token", "unk_token", "add_bos_token")} \
        == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    assert read_json(folder, "generation_config.json")["eos_token_id"] == [2]
    tok = Tokenizer.from_folder(folder)
    assert tok.encode("Hello", add_special_tokens=True)[0] == 1  # no add_bos_token: llama.cpp adds
    assert tok.encode("Hello", add_special_tokens=False)[0] != 1
    assert tok.eos_token_ids == frozenset({2})
    # control tokens are special (dropped by skip_special_tokens), user-defined ones are not
    ids = tok.encode("<s>a<|user|>b</s>")
    assert ids[0] == 1 and ids[-1] == 2 and 3 in ids
    assert tok.decode(ids, skip_special_tokens=True) == "a<|user|> b"
    prompt = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert prompt[:2] == [1, *sp_processor().encode("[INST]")[:1]] and prompt.count(1) == 1


def test_streaming_detokenizer_rebuilds_text(spm_model: tuple[Path, Path]) -> None:
    """Byte-fallback pieces arrive one at a time; no half character, no lost space."""
    _, folder = spm_model
    tok = Tokenizer.from_folder(folder)
    detok = tok.detokenizer()
    ids = tok.encode(TEXT)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) + detok.flush() == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_merges_follow_scores() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    # "bc" scores best, so it merges first; "abc" splits as ("a", "bc") and ("ab", "c")
    assert sentencepiece_merges(tokens, scores) == [
        ("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def test_a_vocabulary_without_a_space_prefix_tokenizes_like_its_model(tmp_path: Path) -> None:
    """Gemma's SentencePiece model adds no dummy prefix, and its GGUFs say so
    (`add_space_prefix` false): text is tokenized as it is, like the model itself does,
    and decodes back whole."""
    vocab = spm_vocabulary(dummy_prefix=False)
    write_tiny_gguf(tmp_path / "gemma-style.gguf", spm=vocab, space_prefix=False)
    folder = import_gguf(tmp_path / "gemma-style.gguf", tmp_path / "out")
    ours = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    sp = sentencepiece.SentencePieceProcessor(model_proto=vocab.model_proto)
    got = ours.encode(TEXT, add_special_tokens=False)
    assert got.ids == sp.encode(TEXT)
    assert not got.tokens[0].startswith("\u2581")  # "Größe", not "▁Größe"
    assert ours.decode(got.ids) == TEXT
    # the control: the same vocabulary in a file that does not say so is read with the
    # prefix (llama.cpp's default), and tokenizes otherwise
    write_tiny_gguf(tmp_path / "unsaid.gguf", spm=vocab)
    unsaid = HFTokenizer.from_file(str(import_gguf(tmp_path / "unsaid.gguf", tmp_path / "u")
                                       / "tokenizer.json"))
    assert unsaid.encode(TEXT, add_special_tokens=False).ids != got.ids
