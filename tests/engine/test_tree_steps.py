"""Draft trees in the step loop: texts identical to plain decoding, malformed trees refused.

A scripted policy drafts prompt lookup every step with no cost model (so no pruning): every
time the lookup has diverging earlier matches, the step verifies a real tree. Identity
with trees on for every drafter through the whole session is in test_speculative.py (trees
are on by default there).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import cache_length, make_caches
from engine.drafters.base import RUNNER_UPS, Draft
from engine.drafters.model import ModelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.events import TokenKind
from engine.loading import LoadedModel, load_model
from engine.sampling import SamplingParams, log_probs, sample_coupled
from engine.speculative import speculative_steps
from engine.steps import RawStep, plain_steps, prefill
from engine.tree import ROOT
from engine.tree_policy import ALT_PRIOR
from engine.tuning import EXTRA_NODES, Choice, CostModel, PolicyMemory
from tests.fixtures.tiny_models import write_tiny_model

N_TOKENS = 40
K = 4
# short motifs repeated with different continuations, so lookup finds diverging matches
PROMPT = [7, 8, 9, 10, 7, 8, 11, 12, 7, 8, 9, 13, 7, 8, 11, 14, 7, 8]


class AlwaysDraft:
    """Drafts `name` with K every step; no cost model, so trees are verified unpruned."""

    costs = None

    def __init__(self, name: str = "ngram") -> None:
        self.name = name
        self.memory = PolicyMemory()

    def choose(self, context: Sequence[int], pending: bool = False) -> Choice:
        return Choice(self.name, K, None)

    def observe(self, token: int, branched: bool = False) -> None:
        return None

    def update(self, *args, **kwargs) -> None:
        pass


class BadTrees:
    """A drafter whose trees are malformed in one way (the bad-input cases)."""

    name = "bad"

    def __init__(self, ids: tuple[int, ...], parents: tuple[int, ...]) -> None:
        self.draft = Draft(ids, None, parents)

    def propose(self, context, k, sampling, accept) -> Draft:
        return self.draft

    def propose_tree(self, context, k, extra, **_) -> Draft:
        return self.draft

    def commit(self, context) -> None:
        pass

    def reset(self) -> None:
        pass


class OracleTrees:
    """Trees that hide plain decoding's continuation (`truth`, from a plain run) on a random
    branch, each other branch leaving it at a random depth: the walk must find it there."""

    name = "oracle"

    def __init__(self, truth: list[int], seed: int) -> None:
        self.truth = truth
        self.rng = random.Random(seed)
        self.expected: list[int] = []  # per proposal: how many tokens the walk must accept

    def propose_tree(self, context, k, extra, **_) -> Draft:
        truth = self.truth[len(context) - len(PROMPT):][:k]
        seqs = []
        for _ in range(3):
            keep = self.rng.randint(0, len(truth))
            seqs.append(truth[:keep] + [self.rng.randrange(300) for _ in range(k - keep)])
        self.rng.shuffle(seqs)
        kids: dict[int, dict[int, int]] = {}
        tokens: list[int] = []
        parents: list[int] = []
        for seq in seqs:  # a trie, nodes in insertion order
            node = ROOT
            for tok in seq:
                if tok not in kids.setdefault(node, {}):
                    kids[node][tok] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                node = kids[node][tok]
        order: list[int] = []  # depth-first renumbering
        stack = list(reversed(kids.get(ROOT, {}).values()))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(kids.get(node, {}).values()))
        new = {old: i for i, old in enumerate(order)} | {ROOT: ROOT}
        self.expected.append(max(_common(seq, truth) for seq in seqs))
        return Draft(tuple(tokens[o] for o in order), None,
                     tuple(new[parents[o]] for o in order))

    def propose(self, context, k, sampling, accept) -> Draft:
        return self.propose_tree(context, k, 0)

    def commit(self, context) -> None:
        pass

    def reset(self) -> None:
        pass


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(write_tiny_model(tmp_path_factory.mktemp("treesteps") / "t")))


def run_steps(model, sampling: SamplingParams, drafters=None, policy=None, accept="coupled",
              tree="auto", check_cache=False, n_tokens=N_TOKENS,
              ) -> tuple[list[int], list[RawStep]]:
    """Committed ids (at least N_TOKENS) and the raw steps, plain when `drafters` is None."""
    context = list(PROMPT)
    caches = make_caches(model.n_layers)
    *_, (_, logits) = prefill(model, context, caches, 512)
    if drafters is None:
        steps = plain_steps(model, caches, logits, context, sampling)
    else:
        steps = speculative_steps(model, caches, context, logits, sampling, accept, drafters,
                                  policy, tree=tree)
    out: list[RawStep] = []
    while len(context) < len(PROMPT) + n_tokens:
        step = next(steps)
        out.append(step)
        if check_cache and step.n_drafted:
            # verified: the caches hold the committed context but its newest token, and
            # no tree row outlives the step
            assert cache_length(caches) == len(context) - 1
    steps.close()
    return context[len(PROMPT):len(PROMPT) + n_tokens], out


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.8, seed=11),
                                      SamplingParams(temperature=0.8, seed=5,
                                                     repetition_penalty=1.3)],
                         ids=["T0", "T0.8", "T0.8-rep"])
def test_tree_steps_commit_exactly_the_plain_text(target: LoadedModel,
                                                  sampling: SamplingParams) -> None:
    model = target.model
    plain, _ = run_steps(model, sampling)
    drafters = {"ngram": NgramDrafter(min_n=1)}
    spec, _ = run_steps(model, sampling, drafters, AlwaysDraft(), check_cache=True)
    assert spec == plain


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.8, seed=11)],
                         ids=["T0", "T0.8"])
def test_the_walk_finds_plain_decodings_branch_wherever_it_hides(target: LoadedModel,
                                                                 sampling: SamplingParams,
                                                                 ) -> None:
    model = target.model
    truth, _ = run_steps(model, sampling, n_tokens=N_TOKENS + K + 2)
    oracle = OracleTrees(truth, seed=3)
    spec, steps = run_steps(model, sampling, {"oracle": oracle}, AlwaysDraft("oracle"),
                            check_cache=True)
    assert spec == truth[:N_TOKENS]
    verified = [s for s in steps if s.n_drafted]
    assert [s.n_accepted for s in verified] == oracle.expected[: len(verified)]
    tree_steps = [s for s in verified if s.branches]
    assert len(tree_steps) > len(verified) // 2
    assert any(s.n_accepted for s in tree_steps)
    for s in tree_steps:
        assert sum(k.committed for k in s.kinds) == s.n_accepted + 1
        ghosts = [(i, b) for i, (b, k) in enumerate(zip(s.branches, s.kinds, strict=True))
                  if k is TokenKind.REJECTED]
        # every node off the accepted path shows (a prefix two branches share, twice)
        assert len(ghosts) >= s.n_drafted - s.n_accepted
        for i, label in ghosts:
            # a ghost stands after the committed tokens above the depth it diverged at
            depth = int(label.rsplit("depth ", 1)[1])
            assert sum(k.committed for k in s.kinds[:i]) == depth - 1, (s.kinds, label)


def test_what_trees_learn_about_runner_ups_outlives_the_reply(target: LoadedModel) -> None:
    """The chance a runner-up wins is the drafter's, kept in the session's policy memory:
    a second reply starts from what the first learned, not from the prior again."""
    model, sampling = target.model, SamplingParams(temperature=0.0)
    truth, _ = run_steps(model, sampling, n_tokens=N_TOKENS + K + 2)
    policy = AlwaysDraft("oracle")
    run_steps(model, sampling, {"oracle": OracleTrees(truth, seed=3)}, policy)
    learned = policy.memory.tree_stats["oracle"]
    after_first = (learned.trees, learned.alt.alpha)
    assert after_first[0] > 0 and after_first[1] != pytest.approx(ALT_PRIOR)
    run_steps(model, sampling, {"oracle": OracleTrees(truth, seed=3)}, policy)
    assert policy.memory.tree_stats["oracle"] is learned
    assert learned.trees == 2 * after_first[0]  # the second reply added to the same counts
    # negative control: a fresh memory starts at the prior
    assert AlwaysDraft("oracle").memory.tree_stats == {}


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.8, seed=11)],
                         ids=["T0", "T0.8"])
def test_draft_model_runner_ups_keep_the_plain_text(target: LoadedModel, tmp_path: Path,
                                                    sampling: SamplingParams) -> None:
    """The draft model's trees (its runner-ups as sibling leaves at depths 1-2)."""
    model = target.model
    small = load_model(str(write_tiny_model(tmp_path / "d", hidden_size=32, seed=1)))
    drafter = ModelDrafter(small.model, vocab_size=model.args.vocab_size)
    plain, _ = run_steps(model, sampling)
    spec, steps = run_steps(model, sampling, {"model": drafter}, AlwaysDraft("model"),
                            check_cache=True)
    assert spec == plain
    trees = [s for s in steps if s.branches]
    assert len(trees) == sum(1 for s in steps if s.n_drafted)  # every draft was a tree
    assert all(s.n_drafted == K + sum(RUNNER_UPS) for s in trees)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.8, seed=11)],
                         ids=["T0", "T0.8"])
def test_runner_ups_are_the_next_picks_under_the_same_noise(tmp_path: Path,
                                                            sampling: SamplingParams) -> None:
    """Each depth's leaves are what the draft would have drawn had its own pick (and then
    the first runner-up) been struck out, under the same noise; each node carries its
    share of the softmax of those scores (its confidence), so the likelier leaf comes
    first."""
    small = load_model(str(write_tiny_model(tmp_path / "d", hidden_size=32, seed=1)))
    drafter = ModelDrafter(small.model)
    context = list(PROMPT)
    draft = drafter.propose_tree(context, K, sum(RUNNER_UPS), sampling=sampling)
    assert draft.gaps is None and draft.conf is not None
    tree = draft.tree
    assert len(tree) == K + sum(RUNNER_UPS) == len(draft.conf)
    for depth, count in enumerate(RUNNER_UPS, start=1):
        leaves = [j for j in range(K, len(tree)) if tree.depths[j] == depth]
        chosen = [draft.ids[depth - 1]]
        row = (drafter._drawn.logits[depth - 1] if sampling.greedy
               else log_probs(drafter._drawn.logits[depth - 1], sampling))
        for _ in range(count):
            masked = row.astype(mx.float32)
            for tok in chosen:
                masked[:, tok] = -mx.inf
            want = (int(mx.argmax(masked[0]).item()) if sampling.greedy else
                    int(sample_coupled(masked, sampling.seed, [len(context) + depth - 1])[0]))
            chosen.append(want)
        assert [draft.ids[j] for j in leaves] == chosen[1:], f"depth {depth}"
        conf = [draft.conf[j] for j in leaves]
        # the chain's pick is the likeliest under the noise; its leaves follow in order
        assert draft.conf[depth - 1] >= conf[0] and conf == sorted(conf, reverse=True)
    # at T = 0 a node's confidence is the draft's own probability of its token
    if sampling.greedy:
        for j in (0, K):  # the chain's first node, the deepest fork's likeliest leaf
            depth = tree.depths[j]
            row = drafter._drawn.logits[depth - 1].astype(mx.float32)
            p = np.array(mx.softmax(row))[0]
            assert draft.conf[j] == pytest.approx(p[draft.ids[j]], abs=1e-5)


def test_trees_off_and_the_rejection_rule_verify_chains(target: LoadedModel) -> None:
    model = target.model
    sampling = SamplingParams(temperature=0.0)
    plain, _ = run_steps(model, sampling)
    for accept, tree in (("coupled", "off"), ("rejection", "auto")):
        drafters = {"ngram": NgramDrafter(min_n=1)}
        spec, steps = run_steps(model, sampling, drafters, AlwaysDraft(), accept, tree)
        assert spec == plain
        assert not any(s.branches for s in steps)
        assert all(s.n_drafted <= K for s in steps)


class PaddedDraft(AlwaysDraft):
    """AlwaysDraft on a cost curve where `dip` rows cost what 1 does and any width between
    costs three times that. Records the widths its passes were timed at."""

    def __init__(self, dip: int) -> None:
        super().__init__()
        self.costs = CostModel({1: 1.0, 2: 3.0, dip - 1: 3.0, dip: 1.0})
        self.estimates: dict = {}
        self.widths: list[int] = []

    def update(self, choice, n_drafted, n_accepted, seconds=None, width=None, *args) -> None:
        self.widths.append(width)


# (the tiny model often settles into repeating one token, where lookup has nothing to
# branch on: these seeds give it diverging matches)
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.8, seed=11),
                                      SamplingParams(temperature=0.8, seed=2)],
                         ids=["seed11", "seed2"])
@pytest.mark.parametrize("tree", ["auto", "off"])
def test_padded_passes_commit_exactly_the_plain_text(target: LoadedModel, tree: str,
                                                     sampling: SamplingParams) -> None:
    model = target.model
    plain, _ = run_steps(model, sampling)
    budget = 1 + K + EXTRA_NODES  # the most rows a step with K drafts may take
    for dip, padded in ((budget, True), (budget + 1, False)):
        policy = PaddedDraft(dip)
        spec, steps = run_steps(model, sampling, {"ngram": NgramDrafter(min_n=1)}, policy,
                                tree=tree, check_cache=True)
        assert spec == plain
        drafted = [s for s in steps if s.n_drafted]
        assert drafted and any(s.branches for s in drafted) == (tree == "auto")
        verify_widths = [w for w in policy.widths if w != 1]
        assert len(verify_widths) == len(drafted)
        if padded:  # every verify pass ran (and was timed) `budget` rows wide
            assert set(verify_widths) == {budget}
        else:  # a cheaper width past the budget is not used: each pass keeps its rows
            assert verify_widths == [s.n_drafted + 1 for s in drafted]


class BudgetDraft(PaddedDraft):
    """AlwaysDraft whose branch rows pay only if the pass may pad to a dip at `dip` rows:
    from 2 rows on, every row costs half a 1-row pass more, up to the dip."""

    def __init__(self, dip: int) -> None:
        super().__init__(dip)
        self.costs = CostModel({1: 1.0, 2: 1.1, dip - 1: 1.1 + 0.5 * (dip - 3), dip: 1.0})


def test_trees_are_pruned_at_the_cost_their_step_may_pad_to(target: LoadedModel) -> None:
    """With the dip within the step's row budget the branch rows ride free in the padded
    pass and stay; one row past it they cost what they cost unpadded, and the pruner
    (priced with the step's budget) adds no row to the chain's (a runner-up may still take
    a deep chain node's row)."""
    model = target.model
    sampling = SamplingParams(temperature=0.8, seed=11)
    plain, _ = run_steps(model, sampling)
    budget = 1 + K + EXTRA_NODES
    for dip, branched in ((budget, True), (budget + 1, False)):
        policy = BudgetDraft(dip)
        spec, steps = run_steps(model, sampling, {"ngram": NgramDrafter(min_n=1)}, policy,
                                tree="auto")
        assert spec == plain
        drafted = [s for s in steps if s.n_drafted]
        assert drafted and any(s.n_drafted > K for s in drafted) == branched, dip


@pytest.mark.parametrize(("ids", "parents", "message"), [
    ((5, 6, 7), (-1, 2, 0), "does not come before it"),  # a parent after its child
    ((5, 6), (-1, 1), "does not come before it"),  # a cycle: its own parent
    ((5, 6, 7, 8, 9, 4), (-1, 0, 1, 2, 3, -1), "beyond the budget of 4"),
    ((5, 6, 100_000), (-1, 0, -1), "outside the vocabulary"),
])
def test_a_malformed_tree_runs_a_plain_step_and_says_why(target: LoadedModel, ids, parents,
                                                          message: str) -> None:
    model = target.model
    sampling = SamplingParams(temperature=0.8, seed=2)
    plain, _ = run_steps(model, sampling)
    spec, steps = run_steps(model, sampling, {"bad": BadTrees(ids, parents)},
                            AlwaysDraft("bad"))
    assert spec == plain
    refused = [s for s in steps if s.error]
    # every other step reads the pending token the refused step left (no error there)
    assert len(refused) >= len(steps) // 2
    assert all(message in s.error and s.error.startswith("bad: ") for s in refused)
    assert all(s.n_drafted == 0 and s.kinds == [TokenKind.TARGET] for s in steps)


def test_a_good_tree_from_the_same_drafter_is_verified(target: LoadedModel,
                                                       tmp_path: Path) -> None:
    """Negative control for the test above: a valid tree passes, with no error."""
    model = target.model
    sampling = SamplingParams(temperature=0.0)
    plain, _ = run_steps(model, sampling)
    spec, steps = run_steps(model, sampling, {"bad": BadTrees((5, 6, 7), (-1, 0, -1))},
                            AlwaysDraft("bad"))
    assert spec == plain
    assert all(s.error == "" for s in steps) and any(s.n_drafted == 3 for s in steps)


class WrongGuesses(AlwaysDraft):
    """Every prompt-lookup guess of the pending token is wrong (as `DraftPolicy.observe`
    reports it)."""

    def observe(self, token: int, branched: bool = False) -> bool:
        return False


class Continues(NgramDrafter):
    """Prompt lookup whose other earlier matches (the tree's first layer) always, or
    never, continued with the token the target chose."""

    def __init__(self, hit: bool) -> None:
        super().__init__(min_n=1)
        self.hit = hit

    def continued_with(self, context, token: int) -> bool:
        return self.hit


@pytest.mark.parametrize(("tree", "hit", "drafts"), [("auto", True, True),
                                                      ("auto", False, False),
                                                      ("off", True, False)])
def test_a_wrong_guess_hit_by_another_match_keeps_copying(target: LoadedModel, tree: str,
                                                          hit: bool, drafts: bool) -> None:
    """After prompt lookup's guess of the pending token proves wrong, the next step is
    plain — unless trees are on and another earlier match (a first-layer branch of the
    lookup tree) was followed by that token: then the policy chooses afresh and drafts.
    The text is plain decoding's either way."""
    model, sampling = target.model, SamplingParams(temperature=0.8, seed=4)
    plain, _ = run_steps(model, sampling)
    spec, steps = run_steps(model, sampling, {"ngram": Continues(hit)}, WrongGuesses(),
                            tree=tree)
    assert spec == plain
    drafted = [s for s in steps if s.n_drafted]
    assert bool(drafted) is drafts
    if drafts:  # a wrong guess leads to a draft wherever lookup matched at all
        assert len(drafted) >= len(steps) // 4


class NeverDrafts(AlwaysDraft):
    """Plain steps only; records what each free observation was told."""

    def __init__(self) -> None:
        super().__init__()
        self.branched: list[bool] = []

    def choose(self, context: Sequence[int], pending: bool = False) -> Choice:
        return Choice(None, 0)

    def observe(self, token: int, branched: bool = False) -> None:
        self.branched.append(branched)


@pytest.mark.parametrize(("tree", "hit", "told"), [("auto", True, True),
                                                    ("auto", False, False),
                                                    ("off", True, False)])
def test_a_plain_step_tells_the_policy_when_the_lookup_tree_held_its_token(
        target: LoadedModel, tree: str, hit: bool, told: bool) -> None:
    """With trees on, prompt lookup's worth at a step is its tree's first layer, not its
    chain's first guess: a plain step's free observation says whether another earlier
    match (a first-layer branch) was followed by the token committed. With trees off, or
    where none was, it says no."""
    policy = NeverDrafts()
    run_steps(target.model, SamplingParams(temperature=0.0), {"ngram": Continues(hit)},
              policy, tree=tree)
    assert len(policy.branched) >= N_TOKENS - 1
    assert set(policy.branched) == {told}


def test_a_wrong_lookup_guess_leaves_a_model_drafters_choice_standing(
        target: LoadedModel) -> None:
    """Prompt lookup guesses at almost every step (a one-token match is a match), so its
    wrong guess of the pending token must cancel only its own draft: a model drafter's
    choice was made for its own guess and stands (it was dropped, and with it most of a
    trained head's drafts in chat)."""
    model, sampling = target.model, SamplingParams(temperature=0.0)
    plain, _ = run_steps(model, sampling)
    spec, steps = run_steps(model, sampling, {"bad": BadTrees((5, 6, 7), (-1, 0, 1))},
                            WrongGuesses("bad"))
    assert spec == plain
    assert sum(s.n_drafted > 0 for s in steps) >= len(steps) // 3
    # negative control: the same wrong guesses cancel prompt lookup's own drafts
    spec, steps = run_steps(model, sampling, {"ngram": Continues(False)}, WrongGuesses())
    assert spec == plain and not any(s.n_drafted for s in steps)
