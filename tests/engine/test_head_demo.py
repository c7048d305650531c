"""The demo model with a briefly trained head: coupled decoding stays token-identical.

A few replies and a few optimizer steps make a weak head, which is the point: its drafts
are often wrong, so verification's rejections and replacements run on a real model, and
the text must still equal plain decoding's at T=0 and T=0.8.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.decode import ChatSession, GenerateOptions
from engine.drafters.head_io import current_checkpoint, load_head
from engine.loading import load_model
from engine.sampling import SamplingParams
from engine.training.fit import FitOptions
from engine.training.job import TrainOptions, train_drafter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_with_head(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The demo model and a head trained on its replies to four prompts for six steps."""
    target = load_model(str(demo_model_dir))
    root = tmp_path_factory.mktemp("demo-head")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in (
        "Give me two tips for a good night's sleep.", "What is a rainbow?",
        "Write a haiku about tea.", "Name three fruits.")))
    options = TrainOptions(minutes=10, data=str(prompts), rounds=1, gen_batch=4, max_new=24,
                           max_steps=6, checkpoint_every=100,
                           fit=FitOptions(batch_size=2, window=64))
    events = list(train_drafter(target, options, root=root / "head"))
    assert events[-1].phase == "done" and events[-1].step == 6
    return target, load_head(current_checkpoint(root / "head"), target.model)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_demo_with_trained_head_is_identical_to_plain(demo_with_head,
                                                      temperature: float) -> None:
    target, head = demo_with_head
    sampling = SamplingParams(temperature=temperature, seed=5)
    messages = [{"role": "user", "content": "Tell me a fun fact about octopuses."}]
    plain = list(ChatSession(target).generate(
        messages, GenerateOptions(max_tokens=32, sampling=sampling)))[-1]
    spec = list(ChatSession(target, None, head).generate(
        messages, GenerateOptions(max_tokens=32, sampling=sampling, drafter="head", k=3)))[-1]
    assert spec.token_ids == plain.token_ids
    assert spec.stats.n_drafted > 0
