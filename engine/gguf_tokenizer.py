"""GGUF tokenizer metadata (`tokenizer.ggml.*`) -> `tokenizers` tokenizer and HF configs.

Two vocabulary kinds cover the llama family:

* `gpt2`: byte-level BPE with merges, pre-tokenized by the regex of the original HF
  tokenizer, which `tokenizer.ggml.pre` names (SmolLM, Llama 3, Qwen2).
* `llama`: SentencePiece BPE (Llama 2, Mistral, TinyLlama). The file has pieces and scores
  but usually no merges; SentencePiece merges the adjacent pair whose joined piece scores
  highest, so the merges are every split of every piece into two pieces, best score first.
  Spaces become `▁`, each stretch of text between added tokens gets a `▁` prefix (as
  llama.cpp and the models' own hub `tokenizer.json` do), and characters outside the
  vocabulary fall back to the `<0xNN>` byte pieces.

Token types follow llama.cpp: 3 control and 2 unknown become special added tokens, 4
user-defined plain added tokens, so both are matched whole in text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.gguf_reading import meta_value

# Pre-tokenizer regexes, as in the original HF tokenizers these GGUFs were converted from.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's (tiktoken's o200k_base), which Phi-4-mini uses: words split at case changes
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_KINDS = {
    "default": "gpt2", "gpt2": "gpt2", "gpt-2": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits",
    "llama-bpe": "llama3", "llama3": "llama3", "smaug-bpe": "llama3", "dbrx": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
    "gpt-4o": "gpt4o",
}
_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 2, 3, 4
SPACE = "\u2581"  # SentencePiece's visible space, "▁"


def build_tokenizer(src: Path, meta: dict[str, Any]) -> HFTokenizer:
    """The tokenizer `tokenizer.ggml.model` describes: byte-level BPE or SentencePiece BPE."""
    kind = meta_value(meta, "tokenizer.ggml.model")
    tokens: list[str] = meta_value(meta, "tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelFormatError(f"{src}: metadata field 'tokenizer.ggml.tokens' is missing")
    types: list[int] = meta_value(meta, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok = _byte_level_bpe(src, meta, tokens)
    elif kind == "llama":
        tok = _sentencepiece_bpe(src, meta, tokens, types)
    else:
        raise UnsupportedModelError(
            f"{src}: tokenizer model {kind!r} is not supported (supported: byte-level BPE "
            "'gpt2', SentencePiece BPE 'llama')")
    added = [AddedToken(t, special=ty != _TOKEN_USER_DEFINED, normalized=False)
             for t, ty in zip(tokens, types, strict=False)
             if ty in (_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    bos = meta_value(meta, "tokenizer.ggml.bos_token_id")
    if add_bos(meta) and bos is not None and 0 <= bos < len(tokens):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B:1",
            special_tokens=[(tokens[bos], int(bos))])
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _byte_level_bpe(src: Path, meta: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    """Byte-level BPE from vocab and merges, pre-tokenized as the original HF tokenizer."""
    pre = meta_value(meta, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_KINDS:
        raise UnsupportedModelError(
            f"{src}: tokenizer pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(_PRE_KINDS))})")
    merges: list[str] = meta_value(meta, "tokenizer.ggml.merges") or []
    if not merges:
        raise ModelFormatError(f"{src}: tokenizer merges are missing")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pairs = _merge_pairs(src, merges)
    style = _PRE_KINDS[pre]
    tok = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=style == "llama3"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                          use_regex=style in ("gpt2", "digits"))
    if style == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif style in ("llama3", "qwen2", "gpt4o"):
        split = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "gpt4o": _GPT4O_SPLIT}[style]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _merge_pairs(src: Path, merges: list[str]) -> list[tuple[str, str]]:
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise ModelFormatError(f"{src}: malformed entry in tokenizer.ggml.merges")
    return pairs  # type: ignore[return-value]


def _sentencepiece_bpe(src: Path, meta: dict[str, Any], tokens: list[str], types: list[int]
                       ) -> HFTokenizer:
    """SentencePiece BPE with byte fallback, as the hub's Llama-style tokenizer.json."""
    scores: list[float] = meta_value(meta, "tokenizer.ggml.scores") or []
    merges: list[str] = meta_value(meta, "tokenizer.ggml.merges") or []
    if not merges and len(scores) != len(tokens):
        raise ModelFormatError(
            f"{src}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}  # a repeated piece: the last id, as llama.cpp
    pairs = _merge_pairs(src, merges) if merges else sentencepiece_merges(tokens, scores)
    unk = meta_value(meta, "tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    tok = HFTokenizer(models.BPE(vocab, pairs, unk_token=unk_token, fuse_unk=True,
                                 byte_fallback=True))
    prefix = bool(meta_value(meta, "tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE)] * prefix + [normalizers.Replace(" ", SPACE)])
    tok.pre_tokenizer = None
    strip = [decoders.Strip(" ", 1, 0)] * prefix  # the prefix is not part of the text
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's scores: every split (left, right) of a piece
    into two pieces, ranked by the joined piece's score, best first.

    Ties (SentencePiece vocabularies score pieces by merge order, so they are rare) go to
    the lower id, then to the longer left part.
    """
    ids = {tok: i for i, tok in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, (piece, score) in enumerate(zip(tokens, scores, strict=True)):
        if ids[piece] != i:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-score, i, -cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def add_bos(meta: dict[str, Any]) -> bool:
    """Whether prompts start with BOS; SentencePiece files that do not say, do (llama.cpp)."""
    default = meta_value(meta, "tokenizer.ggml.model") == "llama"
    return bool(meta_value(meta, "tokenizer.ggml.add_bos_token", default))


def _token(meta: dict[str, Any], key: str) -> str | None:
    tokens = meta.get("tokenizer.ggml.tokens") or []
    i = meta_value(meta, key)
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None


def tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """HF tokenizer_config.json: special tokens, BOS policy and the chat template(s)."""
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos(meta),
        "add_eos_token": bool(meta_value(meta, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    for field, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"),
                       ("unk_token", "unknown")):
        text = _token(meta, f"tokenizer.ggml.{key}_token_id")
        if text is not None:
            out[field] = text
    template = meta_value(meta, "tokenizer.chat_template")
    named = [{"name": n, "template": meta_value(meta, f"tokenizer.chat_template.{n}")}
             for n in (meta_value(meta, "tokenizer.chat_templates") or [])]
    if named and template:
        out["chat_template"] = [{"name": "default", "template": template}, *named]
    elif template:
        out["chat_template"] = template
    return out


# control tokens that end a chat turn whatever the metadata names: llama.cpp finds them by
# their text when it loads a file, so converters often leave them out (Gemma 3's files name
# only <eos>, and its replies end with <end_of_turn>)
END_OF_TURN_TEXTS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>")


def generation_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Every id that ends a turn: eos plus llama.cpp's end-of-turn/end-of-message ids, and
    the control tokens of `END_OF_TURN_TEXTS` the vocabulary holds."""
    eos: list[int] = []
    for key in ("eos", "eot", "eom"):
        i = meta_value(meta, f"tokenizer.ggml.{key}_token_id")
        if i is not None and int(i) not in eos:
            eos.append(int(i))
    tokens: list[str] = meta_value(meta, "tokenizer.ggml.tokens") or []
    types: list[int] = meta_value(meta, "tokenizer.ggml.token_type") or []
    for i, (text, kind) in enumerate(zip(tokens, types, strict=False)):
        if kind == _TOKEN_CONTROL and text in END_OF_TURN_TEXTS and i not in eos:
            eos.append(i)
    out: dict[str, Any] = {"eos_token_id": eos}
    if "bos_token_id" in config:
        out["bos_token_id"] = config["bos_token_id"]
    return out
