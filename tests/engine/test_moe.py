"""Qwen3-MoE through the whole engine: each row of a verify pass (a draft tree's too)
routes to its own experts, so speculation stays lossless.

The logits are checked against mlx-lm in test_models.py; here a tiny MoE target (2 of 4
experts per token) with a dense Qwen3 draft of the same tokenizer decodes with each
drafter, chains and trees, and must write plain decoding's tokens. A target drafting for
itself has every draft accepted only where a wide pass's routing equals one-token steps'.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.decode import ChatSession, GenerateOptions
from engine.events import Finished, Step
from engine.loading import load_model
from engine.sampling import SamplingParams
from tests.fixtures.tiny_models import write_tiny_model

PROMPT = [{"role": "user", "content": "def add(a, b):\n    return a + b\n\ndef add(a, b):"}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("moe")
    target = write_tiny_model(root / "target", "qwen3_moe", num_hidden_layers=3, tie=False)
    draft = write_tiny_model(root / "draft", "qwen3", num_hidden_layers=1, hidden_size=32,
                             intermediate_size=64, seed=1)
    return target, draft


def reply(session: ChatSession, **options) -> tuple[list[Step], Finished]:
    events = list(session.generate(PROMPT, GenerateOptions(max_tokens=32, **options)))
    assert isinstance(events[-1], Finished)
    return [e for e in events if isinstance(e, Step)], events[-1]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("tree", ["auto", "off"])
@pytest.mark.parametrize("drafter", ["model", "ngram", "layerskip"])
def test_speculative_text_equals_plain_text(dirs: tuple[Path, Path], drafter: str, tree: str,
                                            temperature: float) -> None:
    session = ChatSession(load_model(str(dirs[0])), load_model(str(dirs[1])))
    sampling = SamplingParams(temperature=temperature, seed=4)
    _, plain = reply(session, sampling=sampling)
    _, spec = reply(session, sampling=sampling, drafter=drafter, tree=tree, k=4)
    assert spec.token_ids == plain.token_ids


def test_an_moe_target_drafting_for_itself_has_every_draft_accepted(
        dirs: tuple[Path, Path]) -> None:
    session = ChatSession(load_model(str(dirs[0])), load_model(str(dirs[0])))
    sampling = SamplingParams(temperature=0.8, seed=2)
    _, plain = reply(session, sampling=sampling)
    steps, spec = reply(session, sampling=sampling, drafter="model", k=4)
    assert spec.token_ids == plain.token_ids
    assert all(s.n_accepted == s.k for s in steps[1:-1])
    assert spec.stats.tau > 3.5  # k + 1 tokens a pass but the first and the last


def test_experts_stored_apart_are_named(tmp_path: Path) -> None:
    """transformers saves each expert apart; the error says what layout is read."""
    import mlx.core as mx

    from engine.errors import EngineError
    from engine.loading import load_weights

    folder = write_tiny_model(tmp_path / "moe", "qwen3_moe", num_hidden_layers=2, tie=False)
    weights = mx.load(str(folder / "model.safetensors"))
    for name in [k for k in weights if ".switch_mlp." in k]:
        stacked = weights.pop(name)
        for e in range(stacked.shape[0]):
            weights[name.replace("switch_mlp.", f"experts.{e}.")] = stacked[e]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(EngineError, match="each expert.s weights are stored apart"):
        load_weights(folder, backend="cpu")
