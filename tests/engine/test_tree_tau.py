"""Draft trees raise tokens per pass over chains, on chat, with a draft model (issue 13).

A tiny random target and a draft that is the target with its weights perturbed
(`write_tiny_model(perturb=)`): on the target's own replies the draft's top-1 agrees with
the target's about 56% of the time, and its top 2 / top 3 hold the target's token about
75% / 84% of the time. At the same K every step (the policy's K pinned), a chain's miss at
depth 1 or 2 is often caught by the tree's runner-up leaves, so the tree commits more per
target pass. The policy prunes each tree on a pinned cost curve (the demo model's on this
2-core CPU), so what it keeps does not depend on this machine's timings or load.

Threshold, set before measuring: tau(trees) >= 1.10 * tau(chains), at T=0 and T=0.8, with
every text identical to plain decoding (coupled rule). Negative control: a draft with
unrelated random weights (top-1 agreement ~1%) has nothing for its runner-ups to catch, and
must stay below the threshold. Measured when written (6 bench chat prompts x 64 tokens,
K = 4): tau 1.79 -> 2.13 (x1.19) at T=0 and 2.21 -> 2.52 (x1.14) at T=0.8; the unrelated
draft x1.005 and x1.03. Other noise seeds for the near draft gave x1.13-1.21.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import make_caches
from engine.drafters.model import ModelDrafter
from engine.loading import LoadedModel, load_model
from engine.sampling import SamplingParams
from engine.speculative import speculative_steps
from engine.steps import plain_steps, prefill
from engine.tuning import CostModel, DraftPolicy
from resources import resource_path
from tests.fixtures.tiny_models import write_tiny_model

pytestmark = pytest.mark.slow  # ~1 minute: the control's passes each draft K tokens

K = 4
N_TOKENS = 64  # per prompt
GAIN = 1.10  # the goal: trees lift tau by at least 10% over chains
# the demo model's verify cost by width on this CPU (tests/engine/test_tuning.py CPU_LIKE):
# a row costs a few percent of a pass, so runner-ups that are right a third of the time pay
PINNED_VERIFY_S = {1: 0.127, 2: 0.136, 3: 0.146, 4: 0.184, 8: 0.204, 16: 0.225}
PINNED_DRAFT_S = 0.01


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    """target; near (its weights + 0.1 sigma of noise per tensor); unrelated (other seed).

    Untied heads: with tied embeddings two tiny random models both favour repeating the
    input token, so even unrelated weights would agree now and then."""
    root = tmp_path_factory.mktemp("tree-tau")
    return {
        "target": load_model(str(write_tiny_model(root / "target", tie=False, seed=0))),
        "near": load_model(str(write_tiny_model(root / "near", tie=False, seed=0,
                                                perturb=0.1, perturb_seed=1))),
        "unrelated": load_model(str(write_tiny_model(root / "unrelated", tie=False,
                                                     seed=7))),
    }


def chat_prompts(target: LoadedModel) -> list[list[int]]:
    """The bench set's chat prompts, as the target's chat template renders them."""
    lines = resource_path("bench", "prompts.jsonl").read_text().splitlines()
    return [target.tokenizer.encode_chat(p["messages"])
            for p in map(json.loads, lines) if p["category"] == "chat"]


class NotedDrafter(ModelDrafter):
    """A draft model that notes each chain it drafts: (the K asked for, the depth drawn)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chains: list[tuple[int, int]] = []

    def propose(self, context, k, sampling, accept, until=None):
        draft = super().propose(context, k, sampling, accept, until)
        self.chains.append((k, len(draft.ids)))
        return draft


def decode(target: LoadedModel, sampling: SamplingParams, draft: LoadedModel | None = None,
           tree: str = "off", fixed_k: int | None = K,
           chains: list[tuple[int, int]] | None = None) -> tuple[list[list[int]], float]:
    """Each chat prompt's first N_TOKENS committed ids (plain decoding without `draft`),
    and tau: committed tokens per target pass over all prompts. `fixed_k` None lets the
    policy choose K; `chains` collects the draft's (K asked, depth drawn) per proposal."""
    model = target.model
    replies: list[list[int]] = []
    n_tokens = n_passes = 0
    for prompt in chat_prompts(target):
        context = list(prompt)
        caches = make_caches(model.n_layers)
        *_, (_, logits) = prefill(model, context, caches, 512)
        if draft is None:
            steps = plain_steps(model, caches, logits, context, sampling)
        else:
            drafter = NotedDrafter(draft.model, vocab_size=model.args.vocab_size)
            costs = CostModel(dict(PINNED_VERIFY_S), {"model": PINNED_DRAFT_S})
            policy = DraftPolicy("model", ("model",), costs, fixed_k=fixed_k)
            steps = speculative_steps(model, caches, context, logits, sampling, "coupled",
                                      {"model": drafter}, policy, tree=tree)
        while len(context) < len(prompt) + N_TOKENS:
            next(steps)  # one step is one target pass
            n_passes += 1
        steps.close()
        if chains is not None and draft is not None:
            chains += drafter.chains
        n_tokens += len(context) - len(prompt)
        replies.append(context[len(prompt):len(prompt) + N_TOKENS])
    return replies, n_tokens / n_passes


def tau_ratio(models: dict[str, LoadedModel], draft: str, sampling: SamplingParams,
              plain: list[list[int]]) -> float:
    """tau(trees) / tau(chains) for one draft, after checking both texts against plain."""
    chains, tau_chains = decode(models["target"], sampling, models[draft], tree="off")
    trees, tau_trees = decode(models["target"], sampling, models[draft], tree="auto")
    assert chains == plain, f"{draft}: chains changed the text"
    assert trees == plain, f"{draft}: trees changed the text"
    print(f"{draft} T={sampling.temperature}: tau chains {tau_chains:.3f} "
          f"trees {tau_trees:.3f} x{tau_trees / tau_chains:.3f}")
    return tau_trees / tau_chains


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.8, seed=3)],
                         ids=["T0", "T0.8"])
def test_trees_raise_tau_over_chains_with_a_correlated_draft_model(
        models: dict[str, LoadedModel], sampling: SamplingParams) -> None:
    plain, _ = decode(models["target"], sampling)
    assert tau_ratio(models, "near", sampling, plain) >= GAIN
    # negative control: runner-ups of a draft that knows nothing of the target win rarely
    assert tau_ratio(models, "unrelated", sampling, plain) < GAIN


def test_the_perturbed_draft_agrees_partly(models: dict[str, LoadedModel]) -> None:
    """The pair is what the docstring says: near agrees often but not always; unrelated
    hardly ever (so the gain above comes from a correlated draft, not from the tree)."""
    plain, _ = decode(models["target"], SamplingParams(temperature=0.0))
    prompts = chat_prompts(models["target"])
    seqs = mx.array([p[-16:] + r for p, r in zip(prompts, plain, strict=True)])
    top_tgt = np.array(mx.argmax(models["target"].model(seqs), axis=-1))
    agree = {}
    for name in ("near", "unrelated"):
        order = np.argsort(-np.array(models[name].model(seqs)), axis=-1)
        agree[name] = [float((order[..., :n] == top_tgt[..., None]).any(-1).mean())
                       for n in (1, 2, 3)]
    assert 0.45 <= agree["near"][0] <= 0.75 and agree["near"][1] >= agree["near"][0] + 0.1
    assert agree["unrelated"][0] < 0.1


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.8, seed=3)],
                         ids=["T0", "T0.8"])
def test_unsure_chains_stop_early_under_the_policys_k(models: dict[str, LoadedModel],
                                                      sampling: SamplingParams) -> None:
    """Under the policy's own K, the draft model stops a chain where its calibrated
    confidence no longer pays for a deeper node (`deeper_pays`), and every text stays
    plain decoding's. Threshold, set in advance: at least a tenth of the chains stop
    short of their K, and some reach it. Negative control: with K pinned, none stops."""
    plain, _ = decode(models["target"], sampling)
    adaptive: list[tuple[int, int]] = []
    replies, _ = decode(models["target"], sampling, models["near"], tree="auto",
                        fixed_k=None, chains=adaptive)
    assert replies == plain
    short = sum(depth < k for k, depth in adaptive)
    assert short >= len(adaptive) / 10 and any(depth == k > 1 for k, depth in adaptive)
    pinned: list[tuple[int, int]] = []
    decode(models["target"], sampling, models["near"], tree="auto", chains=pinned)
    assert pinned and all(depth == k for k, depth in pinned)
