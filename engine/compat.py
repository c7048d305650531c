"""Can this draft model propose tokens for that target? Only if they share a tokenizer.

Speculative decoding feeds the target's token ids to the draft and compares the draft's
proposed ids with the target's own: id 1234 must mean the same string in both, or every
accepted token is a coincidence and the text is garbage. So the two `tokenizer.json`s must
agree on vocabulary size, on every id -> token string, and on which ids are special; the
bos ids (from tokenizer_config.json / config.json) must match, and the eos sets must share
at least one id (otherwise the draft never proposes where the target stops).

Embedding matrices are often padded past the tokenizer (Qwen2.5-7B has 152064 rows, its
0.5B sibling 151936, for the same 151665-token tokenizer). Rows beyond the tokenizer are
never produced by it, so such pairs are compatible; the reasons say so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import IncompatibleDraftError

MAX_LISTED_IDS = 5


@dataclass(frozen=True)
class Compatibility:
    """The verdict; `reasons` explains a failure, or notes what was tolerated on success."""

    ok: bool
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class _TokenizerFacts:
    folder: Path
    tokens: tuple[str | None, ...]  # id -> token string (None for holes)
    special: frozenset[int]
    bos: frozenset[int]
    eos: frozenset[int]
    config_vocab: int | None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _int_ids(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _facts(folder: Path, role: str) -> _TokenizerFacts | str:
    """Everything we compare, or a reason string if the tokenizer cannot be read."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        return f"{role}: {path} is missing"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
        return f"{role}: {path} cannot be read ({e})"
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(vocab.values(), default=-1) + 1
    tokens: list[str | None] = [None] * size
    for text, i in vocab.items():
        tokens[i] = text
    special = {i for i, added in tok.get_added_tokens_decoder().items() if added.special}
    tok_cfg = _read_json(folder / "tokenizer_config.json")
    cfg = _read_json(folder / "config.json")
    gen = _read_json(folder / "generation_config.json")

    def ids_of(key: str) -> set[int]:
        found = _int_ids(cfg.get(f"{key}_token_id")) | _int_ids(gen.get(f"{key}_token_id"))
        text = _content(tok_cfg.get(f"{key}_token"))
        if text is not None and text in vocab:
            found.add(vocab[text])
        return found

    bos = ids_of("bos")
    if tok_cfg.get("add_bos_token") is False and _content(tok_cfg.get("bos_token")) is None:
        bos = set()  # no bos is ever added; a config's leftover bos_token_id does not matter
    vocab_size = cfg.get("vocab_size")
    return _TokenizerFacts(folder, tuple(tokens), frozenset(special), frozenset(bos),
                           frozenset(ids_of("eos")),
                           vocab_size if isinstance(vocab_size, int) else None)


def _ids_text(ids: list[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:MAX_LISTED_IDS])
    return shown + (f" and {len(ids) - MAX_LISTED_IDS} more" if len(ids) > MAX_LISTED_IDS else "")


def check_draft_compatible(target_dir: Path, draft_dir: Path) -> Compatibility:
    """Compare the tokenizers of two model folders; see the module docstring for the rules."""
    tgt = _facts(Path(target_dir), "target")
    dft = _facts(Path(draft_dir), "draft")
    problems = [f for f in (tgt, dft) if isinstance(f, str)]
    if problems:
        return Compatibility(False, tuple(problems))
    assert isinstance(tgt, _TokenizerFacts) and isinstance(dft, _TokenizerFacts)
    reasons: list[str] = []
    notes: list[str] = []
    n_tgt, n_dft = len(tgt.tokens), len(dft.tokens)
    if n_tgt != n_dft:
        reasons.append(f"vocabulary sizes differ: target {n_tgt} tokens, draft {n_dft}")
    differing = [i for i in range(min(n_tgt, n_dft)) if tgt.tokens[i] != dft.tokens[i]]
    if differing:
        i = differing[0]
        reasons.append(
            f"{len(differing)} token ids map to different strings (first: {_ids_text(differing)}; "
            f"id {i} is {tgt.tokens[i]!r} in the target, {dft.tokens[i]!r} in the draft)")
    if tgt.special != dft.special:
        only_t = sorted(tgt.special - dft.special)
        only_d = sorted(dft.special - tgt.special)
        reasons.append("special tokens differ"
                       + (f"; only the target marks ids {_ids_text(only_t)}" if only_t else "")
                       + (f"; only the draft marks ids {_ids_text(only_d)}" if only_d else ""))
    if tgt.bos != dft.bos:
        reasons.append(f"bos ids differ: target {sorted(tgt.bos)}, draft {sorted(dft.bos)}")
    if tgt.eos and dft.eos and not tgt.eos & dft.eos:
        reasons.append(f"eos ids differ: target {sorted(tgt.eos)}, draft {sorted(dft.eos)}")
    elif tgt.eos != dft.eos:
        notes.append(f"eos ids differ but overlap (target {sorted(tgt.eos)}, draft "
                     f"{sorted(dft.eos)}); the target's decide when to stop")
    for role, facts, n in (("target", tgt, n_tgt), ("draft", dft, n_dft)):
        if facts.config_vocab is not None and facts.config_vocab < n:
            reasons.append(f"{role}: config.json vocab_size {facts.config_vocab} is smaller than "
                           f"its tokenizer's {n} tokens")
    if (not reasons and tgt.config_vocab and dft.config_vocab
            and tgt.config_vocab != dft.config_vocab):
        notes.append(
            f"embedding sizes differ only by padding (target {tgt.config_vocab} rows, draft "
            f"{dft.config_vocab}, tokenizer {n_tgt} tokens); the tokenizers agree, so the pair "
            "is compatible")
    if reasons:
        return Compatibility(False, tuple(reasons))
    return Compatibility(True, tuple(notes))


def require_compatible(target_dir: Path, draft_dir: Path) -> Compatibility:
    """Like `check_draft_compatible`, but raise `IncompatibleDraftError` with the reasons."""
    verdict = check_draft_compatible(target_dir, draft_dir)
    if not verdict.ok:
        raise IncompatibleDraftError(
            f"{draft_dir} cannot draft for {target_dir}: " + "; ".join(verdict.reasons))
    return verdict
