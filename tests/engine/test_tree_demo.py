"""Draft trees on the real demo model (slow): the text stays plain decoding's.

The step loop drafts every step without a cost model, so every tree the sources build is
verified unpruned — on real code-editing text prompt lookup finds diverging earlier
matches, and the draft model (here the demo drafting for itself) adds its runner-ups.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.drafters.model import ModelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.loading import LoadedModel, load_model
from engine.sampling import SamplingParams
from engine.tuning import EXTRA_NODES
from resources import resource_path
from tests.engine import test_tree_steps as steps_mod
from tests.engine.test_tree_steps import AlwaysDraft, run_steps

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(demo_model_dir: Path) -> LoadedModel:
    return load_model(str(demo_model_dir))


def code_edit_prompt(demo: LoadedModel) -> list[int]:
    """The first code-editing prompt of the bundled bench set, as the chat template has it."""
    for line in resource_path("bench", "prompts.jsonl").read_text().splitlines():
        p = json.loads(line)
        if p["category"] == "code-editing":
            return demo.tokenizer.encode_chat(p["messages"])
    raise AssertionError("no code-editing prompt in the bench set")


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.8, seed=3)],
                         ids=["T0", "T0.8"])
def test_demo_trees_commit_plain_decodings_text(demo: LoadedModel, sampling: SamplingParams,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps_mod, "PROMPT", code_edit_prompt(demo))
    monkeypatch.setattr(steps_mod, "N_TOKENS", 24)
    model = demo.model
    plain, _ = run_steps(model, sampling)
    for name, drafter in (("ngram", NgramDrafter()), ("model", ModelDrafter(model))):
        spec, steps = run_steps(model, sampling, {name: drafter}, AlwaysDraft(name),
                                check_cache=True)
        assert spec == plain, name
        trees = [s for s in steps if s.branches]
        assert trees, f"{name}: no tree was verified"
        assert all(s.n_drafted <= steps_mod.K + EXTRA_NODES for s in trees)
