"""Each model family beyond llama through the whole engine: speculation stays lossless.

Their logits are checked against mlx-lm in test_models.py. Here each family's tiny target
decodes with every drafter it can pair with, chains and trees, at T = 0 and T = 0.8, and
must write plain decoding's tokens; a target drafting for itself has every draft accepted
only where a wide pass's rows (at a tree's own positions) equal one-token steps exactly:
- Gemma 3: a sliding window of 8 on two of every three layers, which every reply crosses;
- Qwen3-MoE: 2 of 4 experts per token, each row of a pass routed on its own, with a dense
  Qwen3 draft of the same tokenizer;
- Phi-4-mini-like: fused projections, three quarters of each head rotated, LongRoPE, with
  a small Phi-3 draft.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

from engine.decode import ChatSession, GenerateOptions
from engine.errors import EngineError
from engine.events import Finished, Step
from engine.loading import load_model, load_weights
from engine.sampling import SamplingParams
from tests.engine.test_models import PHI4_MINI_ROPE
from tests.fixtures.tiny_models import write_tiny_gemma3_vlm, write_tiny_model

PROMPT = [{"role": "user", "content": "def add(a, b):\n    return a + b\n\ndef add(a, b):"}]
SMALL_DRAFT = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "seed": 1}

# family -> (write the target under a folder, write a draft of its tokenizer there)
FAMILIES: dict[str, tuple[Callable[[Path], Path], Callable[[Path], Path]]] = {
    "gemma3": (lambda root: write_tiny_model(root / "t", "gemma3_text", num_hidden_layers=3),
               lambda root: write_tiny_model(root / "d", "gemma3_text", **SMALL_DRAFT)),
    "qwen3_moe": (lambda root: write_tiny_model(root / "t", "qwen3_moe", num_hidden_layers=3,
                                                tie=False),
                  lambda root: write_tiny_model(root / "d", "qwen3", **SMALL_DRAFT)),
    "phi4_mini": (lambda root: write_tiny_model(root / "t", "phi3", num_hidden_layers=3,
                                                config_overrides=PHI4_MINI_ROPE),
                  lambda root: write_tiny_model(root / "d", "phi3", **SMALL_DRAFT)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    write_target, write_draft = FAMILIES[request.param]
    return request.param, write_target(root), write_draft(root)


def reply(session: ChatSession, max_tokens: int = 32, **options) -> tuple[list[Step], Finished]:
    events = list(session.generate(PROMPT, GenerateOptions(max_tokens=max_tokens, **options)))
    assert isinstance(events[-1], Finished)
    return [e for e in events if isinstance(e, Step)], events[-1]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("tree", ["auto", "off"])
@pytest.mark.parametrize("drafter", ["model", "ngram", "layerskip"])
def test_speculative_text_equals_plain_text(family: tuple[str, Path, Path], drafter: str,
                                            tree: str, temperature: float) -> None:
    name, target, draft = family
    session = ChatSession(load_model(str(target)), load_model(str(draft)))
    sampling = SamplingParams(temperature=temperature, seed=4)
    _, plain = reply(session, sampling=sampling)
    if name == "gemma3":  # every reply reads past the window
        assert plain.stats.prompt_tokens + plain.stats.generated_tokens > 3 * 8
    _, spec = reply(session, sampling=sampling, drafter=drafter, tree=tree, k=4)
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text


def test_a_target_drafting_for_itself_has_every_draft_accepted(
        family: tuple[str, Path, Path]) -> None:
    _, target, _ = family
    session = ChatSession(load_model(str(target)), load_model(str(target)))
    sampling = SamplingParams(temperature=0.8, seed=2)
    _, plain = reply(session, 40, sampling=sampling)
    steps, spec = reply(session, 40, sampling=sampling, drafter="model", k=4)
    assert spec.token_ids == plain.token_ids
    assert all(s.n_accepted == s.k for s in steps[1:-1])
    assert spec.stats.tau > 3.5  # k + 1 tokens a pass but the first and the last


def test_gemma3_text_size_drafts_for_the_image_and_text_size(tmp_path: Path) -> None:
    """Gemma 3 12B (an image-and-text checkpoint, its embedding padded past the shared
    tokenizer) drafted for by the 1B (text only): the pair is accepted and the text is
    plain decoding's."""
    target = write_tiny_gemma3_vlm(tmp_path / "big", num_hidden_layers=3, vocab_size=320)
    draft = write_tiny_model(tmp_path / "small", "gemma3_text", **SMALL_DRAFT)
    session = ChatSession(load_model(str(target)), load_model(str(draft)))
    assert session.target.model.args.vocab_size == 320
    for temperature in (0.0, 0.8):
        sampling = SamplingParams(temperature=temperature, seed=9)
        _, plain = reply(session, sampling=sampling)
        _, spec = reply(session, sampling=sampling, drafter="model", k=3)
        assert spec.token_ids == plain.token_ids


def test_moe_experts_stored_apart_are_named(tmp_path: Path) -> None:
    """transformers saves each expert apart; the error says what layout is read."""
    folder = write_tiny_model(tmp_path / "moe", "qwen3_moe", num_hidden_layers=2, tie=False)
    weights = mx.load(str(folder / "model.safetensors"))
    for name in [k for k in weights if ".switch_mlp." in k]:
        stacked = weights.pop(name)
        for e in range(stacked.shape[0]):
            weights[name.replace("switch_mlp.", f"experts.{e}.")] = stacked[e]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(EngineError, match="each expert.s weights are stored apart"):
        load_weights(folder, backend="cpu")
