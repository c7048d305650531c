"""Phi-3/Phi-4 through the whole engine: fused projections, partial rotary and LongRoPE
stay lossless under speculation (a tree's rows turn at their own positions).

The logits are checked against mlx-lm in test_models.py; here a tiny Phi-4-mini-like
target (three quarters of each head rotated, LongRoPE) decodes with prompt lookup and its
own early layers, chains and trees, and must write plain decoding's tokens; a target
drafting for itself has every draft accepted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.decode import ChatSession, GenerateOptions
from engine.events import Finished, Step
from engine.loading import load_model
from engine.sampling import SamplingParams
from tests.engine.test_models import PHI4_MINI_ROPE
from tests.fixtures.tiny_models import write_tiny_model

PROMPT = [{"role": "user", "content": "def add(a, b):\n    return a + b\n\ndef add(a, b):"}]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("phi") / "t", "phi3", num_hidden_layers=3,
                            config_overrides=PHI4_MINI_ROPE)


def reply(session: ChatSession, **options) -> tuple[list[Step], Finished]:
    events = list(session.generate(PROMPT, GenerateOptions(max_tokens=32, **options)))
    assert isinstance(events[-1], Finished)
    return [e for e in events if isinstance(e, Step)], events[-1]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("tree", ["auto", "off"])
@pytest.mark.parametrize("drafter", ["ngram", "layerskip"])
def test_speculative_text_equals_plain_text(target: Path, drafter: str, tree: str,
                                            temperature: float) -> None:
    session = ChatSession(load_model(str(target)))
    sampling = SamplingParams(temperature=temperature, seed=4)
    _, plain = reply(session, sampling=sampling)
    _, spec = reply(session, sampling=sampling, drafter=drafter, tree=tree, k=4)
    assert spec.token_ids == plain.token_ids


def test_a_phi_target_drafting_for_itself_has_every_draft_accepted(target: Path) -> None:
    session = ChatSession(load_model(str(target)), load_model(str(target)))
    sampling = SamplingParams(temperature=0.8, seed=2)
    _, plain = reply(session, sampling=sampling)
    steps, spec = reply(session, sampling=sampling, drafter="model", k=4)
    assert spec.token_ids == plain.token_ids
    assert all(s.n_accepted == s.k for s in steps[1:-1])
    assert spec.stats.tau > 3.5
