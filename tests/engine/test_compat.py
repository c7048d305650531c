"""Draft/target tokenizer compatibility on real tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.compat import check_draft_compatible, require_compatible
from engine.errors import IncompatibleDraftError
from tests.fixtures.tiny_models import special_token_id, tokenizer_vocab_size, write_tokenizer


def _model(root: Path, name: str, **config) -> Path:
    folder = root / name
    write_tokenizer(folder)
    cfg = {"model_type": "llama", "vocab_size": tokenizer_vocab_size(),
           "eos_token_id": special_token_id("<|im_end|>")}
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _edit_tokenizer(folder: Path, edit) -> None:
    data = json.loads((folder / "tokenizer.json").read_text())
    edit(data)
    (folder / "tokenizer.json").write_text(json.dumps(data))


def _edit_tok_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(changes)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_same_tokenizer_is_compatible(tmp_path):
    verdict = check_draft_compatible(_model(tmp_path, "t"), _model(tmp_path, "d"))
    assert verdict.ok and verdict.reasons == ()


def test_padded_embeddings_are_compatible_and_say_so(tmp_path):
    n = tokenizer_vocab_size()
    verdict = check_draft_compatible(_model(tmp_path, "t", vocab_size=n + 64),
                                     _model(tmp_path, "d", vocab_size=n + 8))
    assert verdict.ok
    assert "padding" in verdict.reasons[0] and str(n + 64) in verdict.reasons[0]


def test_a_renamed_token_reports_the_first_differing_id(tmp_path):
    target, draft = _model(tmp_path, "t"), _model(tmp_path, "d")
    vocab = json.loads((draft / "tokenizer.json").read_text())["model"]["vocab"]
    token, token_id = sorted(vocab.items(), key=lambda kv: kv[1])[100]

    def rename(data):
        data["model"]["vocab"]["Zq" + token] = data["model"]["vocab"].pop(token)

    _edit_tokenizer(draft, rename)
    verdict = check_draft_compatible(target, draft)
    assert not verdict.ok
    assert f"first: {token_id}" in verdict.reasons[0] and repr(token) in verdict.reasons[0]


def test_different_vocab_size_and_special_tokens_are_incompatible(tmp_path):
    target, draft = _model(tmp_path, "t"), _model(tmp_path, "d")

    def add_special(data):
        new_id = max(data["model"]["vocab"].values()) + 1
        data["added_tokens"].append({"id": new_id, "content": "<|extra|>", "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": True})

    _edit_tokenizer(draft, add_special)
    verdict = check_draft_compatible(target, draft)
    assert not verdict.ok
    joined = " | ".join(verdict.reasons)
    assert "vocabulary sizes differ" in joined and "special tokens differ" in joined


def test_eos_and_bos_mismatches(tmp_path):
    im_end, eot = special_token_id("<|im_end|>"), special_token_id("<|endoftext|>")
    target = _model(tmp_path, "t")
    disjoint = _model(tmp_path, "d1", eos_token_id=eot)
    _edit_tok_config(disjoint, eos_token="<|endoftext|>")
    verdict = check_draft_compatible(target, disjoint)
    assert not verdict.ok and "eos ids differ" in verdict.reasons[0]
    overlap = _model(tmp_path, "d2", eos_token_id=[im_end, eot])
    verdict = check_draft_compatible(target, overlap)
    assert verdict.ok and "overlap" in verdict.reasons[0]
    with_bos = _model(tmp_path, "d3")
    _edit_tok_config(with_bos, add_bos_token=True, bos_token="<|endoftext|>")
    verdict = check_draft_compatible(target, with_bos)
    assert not verdict.ok and "bos ids differ" in verdict.reasons[0]


def test_missing_tokenizer_and_require_compatible(tmp_path):
    target = _model(tmp_path, "t")
    draft = tmp_path / "empty"
    draft.mkdir()
    verdict = check_draft_compatible(target, draft)
    assert not verdict.ok and "draft" in verdict.reasons[0] and "missing" in verdict.reasons[0]
    with pytest.raises(IncompatibleDraftError, match="tokenizer.json is missing"):
        require_compatible(target, draft)
    shutil.copytree(target, tmp_path / "copy")
    assert require_compatible(target, tmp_path / "copy").ok
