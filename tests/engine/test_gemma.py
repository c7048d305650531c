"""Gemma 3 text models (`gemma3_text`) through the whole engine: speculation stays
lossless across their sliding windows.

The logits themselves are checked against mlx-lm in test_models.py; here a tiny Gemma pair
(a window of 8 on two of every three layers, so every reply runs past it) decodes with each
drafter, chains and trees, and must write plain decoding's tokens. A target drafting for
itself has every draft accepted only where the verify pass's rows (windowed, at a tree's
positions) equal one-token steps exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.decode import ChatSession, GenerateOptions
from engine.events import Finished, Step
from engine.loading import load_model
from engine.sampling import SamplingParams
from tests.fixtures.tiny_models import write_tiny_pair

PROMPT = [{"role": "user", "content": "def add(a, b):\n    return a + b\n\ndef add(a, b):"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_tiny_pair(tmp_path_factory.mktemp("gemma"), "gemma3_text",
                           num_hidden_layers=3)


def reply(session: ChatSession, **options) -> tuple[list[Step], Finished]:
    events = list(session.generate(PROMPT, GenerateOptions(max_tokens=40, **options)))
    assert isinstance(events[-1], Finished)
    return [e for e in events if isinstance(e, Step)], events[-1]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("tree", ["auto", "off"])
@pytest.mark.parametrize("drafter", ["model", "ngram", "layerskip"])
def test_speculative_text_equals_plain_text(pair: tuple[Path, Path], drafter: str, tree: str,
                                            temperature: float) -> None:
    session = ChatSession(load_model(str(pair[0])), load_model(str(pair[1])))
    sampling = SamplingParams(temperature=temperature, seed=4)
    _, plain = reply(session, sampling=sampling)
    assert plain.stats.prompt_tokens + plain.stats.generated_tokens > 3 * 8  # past the window
    _, spec = reply(session, sampling=sampling, drafter=drafter, tree=tree, k=4)
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text


def test_a_gemma_target_drafting_for_itself_has_every_draft_accepted(
        pair: tuple[Path, Path]) -> None:
    target = load_model(str(pair[0]))
    session = ChatSession(target, load_model(str(pair[0])))
    sampling = SamplingParams(temperature=0.8, seed=2)
    _, plain = reply(session, sampling=sampling)
    steps, spec = reply(session, sampling=sampling, drafter="model", k=4)
    assert spec.token_ids == plain.token_ids
    assert all(s.n_accepted == s.k for s in steps[1:-1])
    assert spec.stats.tau > 4.0


def test_the_text_size_drafts_for_the_image_and_text_size(tmp_path: Path) -> None:
    """Gemma 3 12B (an image-and-text checkpoint, its embedding padded past the shared
    tokenizer) drafted for by the 1B (text only): the pair is accepted and the text is
    plain decoding's."""
    from tests.fixtures.tiny_models import write_tiny_gemma3_vlm, write_tiny_model

    target = write_tiny_gemma3_vlm(tmp_path / "big", num_hidden_layers=3, vocab_size=320)
    draft = write_tiny_model(tmp_path / "small", "gemma3_text", num_hidden_layers=1,
                             hidden_size=32, intermediate_size=64, seed=1)
    session = ChatSession(load_model(str(target)), load_model(str(draft)))
    assert session.target.model.args.vocab_size == 320
    for temperature in (0.0, 0.8):
        sampling = SamplingParams(temperature=temperature, seed=9)
        _, plain = reply(session, sampling=sampling)
        _, spec = reply(session, sampling=sampling, drafter="model", k=3)
        assert spec.token_ids == plain.token_ids
