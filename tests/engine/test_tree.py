"""Draft trees: the contract, its validation, the masked pass, the coupled walk, the gather.

The tree pass must give every node exactly the row a chain through it would give (same
mask semantics, same RoPE positions), the walk must commit what plain decoding commits
(a property test over random trees and random target distributions), and the gather must
leave the cache as if the accepted path had been fed as a chain.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache import cache_length, make_caches
from engine.drafters.base import Draft
from engine.drafters.ngram import NgramDrafter
from engine.events import TokenKind
from engine.loading import LoadedModel, load_model
from engine.sampling import SamplingParams, coupled_rows
from engine.speculative import checked_draft, verified_step
from engine.tree import (
    ROOT,
    DraftTree,
    TreeError,
    ancestor_mask,
    kept_rows,
    row_positions,
    validate_tree,
)
from engine.tree_policy import (
    ALT_PRIOR,
    TreeStats,
    arrival,
    deeper_pays,
    prune_draft,
    prune_tree,
)
from engine.tree_verify import TreeVerdict, commit_path, tree_pass, verify_tree_coupled
from engine.tuning import EXTRA_NODES, CostModel
from engine.verify import verify_coupled_logits
from tests.fixtures.tiny_models import write_tiny_model

# node:     0  1  2  3  4  5
# tokens:   5  6  7  8  9  4     0 -> 1 -> 2 is the first chain; 3 forks under 0;
# parents: -1  0  1  0  3 -1     4 under 3; 5 is a second root child
TREE = DraftTree((5, 6, 7, 8, 9, 4), (-1, 0, 1, 0, 3, -1))
# TREE's best nodes in its chain's three rows at 50% acceptance: the chain's first two and
# the depth-1 runner-up
CHAIN_WIDTH = DraftTree((5, 6, 4), (-1, 0, -1))


PHI_PARTIAL_ROTARY = {"partial_rotary_factor": 0.5}


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "phi3"])
def target(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
           ) -> LoadedModel:
    """A tiny target; the Gemma one slides a window of 8 over most layers, which the
    tests' contexts cross, so a tree's rows meet the window's edge too; the Phi one turns
    half of each head at a tree's per-row positions."""
    folder = tmp_path_factory.mktemp("tree") / request.param
    overrides = PHI_PARTIAL_ROTARY if request.param == "phi3" else None
    return load_model(str(write_tiny_model(folder, request.param, num_hidden_layers=3,
                                           config_overrides=overrides)))


# ----------------------------------------------------------------------------- the contract


def test_shape_of_a_tree() -> None:
    assert TREE.depths == (1, 2, 3, 2, 3, 1)
    assert TREE.first_chain() == 3 and not TREE.is_chain
    assert TREE.children == {ROOT: (0, 5), 0: (1, 3), 1: (2,), 3: (4,)}
    assert TREE.path(4) == [0, 3, 4]
    assert DraftTree.chain([3, 4, 5]).parents == (-1, 0, 1)
    assert DraftTree.chain([3, 4, 5]).is_chain
    assert TREE.leaf_paths() == ((0, 1, 2), (0, 3, 4), (5,))
    assert DraftTree.chain([3, 4]).leaf_paths() == ((0, 1),)


def test_losing_branches_show_where_they_left_the_accepted_path() -> None:
    """Display order: each losing branch right after the committed token it hangs from."""
    A, R, P, B = TokenKind.ACCEPTED, TokenKind.REJECTED, TokenKind.REPLACED, TokenKind.BONUS
    probs = (0.9, None, None, 0.8, 0.7, None)
    # the walk took 5 -> 8 and then the target's 77 (node 3 still had a child: REPLACED)
    ids, kinds, _, names = verified_step(TREE, TreeVerdict((0, 3), 77, 0.5, probs))
    assert list(zip(ids, kinds, names, strict=True)) == [
        (4, R, "branch 3 of 3, diverged at depth 1"),  # node 5, beside node 0
        (5, A, ""),
        (6, R, "branch 1 of 3, diverged at depth 2"),  # nodes 1, 2 under node 0
        (7, R, "branch 1 of 3, diverged at depth 2"),
        (8, A, ""),
        (9, R, "branch 2 of 3, diverged at depth 3"),  # node 4: the target said 77 there
        (77, P, ""),
    ]
    # the walk ends at the leaf 9: BONUS, and branch 2 lost nothing
    ids, kinds, _, _ = verified_step(TREE, TreeVerdict((0, 3, 4), 77, 0.5, probs))
    assert ids == [4, 5, 6, 7, 8, 9, 77] and kinds == [R, A, R, R, A, A, B]
    # two branches sharing a losing prefix: each ghost is one whole guess
    fork = DraftTree((5, 6, 7, 8, 9), (-1, 0, 1, 1, -1))  # 5 -> 6 -> {7, 8}; 9
    ids, kinds, _, names = verified_step(fork, TreeVerdict((4,), 77, 0.5, (None,) * 5))
    assert ids == [5, 6, 7, 5, 6, 8, 9, 77] and kinds == [R] * 6 + [A, B]
    assert names[3] == "branch 2 of 3, diverged at depth 1"
    # a chain: its rejected tail before the REPLACED token, unnamed
    ids, kinds, _, names = verified_step(DraftTree.chain([5, 6, 7]),
                                         TreeVerdict((0,), 77, 0.5, (0.9, 0.1, None)))
    assert ids == [5, 6, 7, 77] and kinds == [A, R, R, P] and names is None


def test_ancestor_mask_and_positions() -> None:
    mask = np.array(ancestor_mask(TREE, 2))
    assert mask.shape == (7, 9)
    assert mask[:, :3].all()  # committed rows and the newest token: everyone sees them
    seen = {r: [c - 3 for c in range(3, 9) if mask[r, c]] for r in range(7)}
    assert seen == {0: [], 1: [0], 2: [0, 1], 3: [0, 1, 2], 4: [0, 3], 5: [0, 3, 4], 6: [5]}
    assert row_positions(TREE, 10) == [10, 11, 12, 13, 12, 13, 11]
    assert kept_rows([0, 3, 4]) == [0, 1, 4, 5]


@pytest.mark.parametrize(("tree", "message"), [
    (DraftTree((5, 6), (-1, 1)), "does not come before it"),  # a cycle (its own parent)
    (DraftTree((5, 6, 7), (-1, 2, 0)), "does not come before it"),  # parent after child
    (DraftTree((5, 6, 7), (-1, 0, 1)), "depth 3, beyond the budget of 2"),
    (DraftTree((5, 999), (-1, 0)), "outside the vocabulary"),
    (DraftTree((5, -1), (-1, 0)), "outside the vocabulary"),
    (DraftTree((5, 6, 7, 8), (-1, 0, -1, 1)), "not in depth-first order"),
    (DraftTree((5, 6), (-1,)), "2 tokens but 1 parent"),
    (DraftTree((5, 5), (-1, -1)), "repeats token 5"),
    (DraftTree((5, 6), (-1, -3)), "neither a node nor the root"),
    (DraftTree(tuple(range(1, 7)), (-1, -1, -1, -1, -1, -1)), "exceed the budget of 5"),
])
def test_malformed_trees_are_named(tree: DraftTree, message: str) -> None:
    with pytest.raises(TreeError, match=message):
        validate_tree(tree, vocab_size=300, max_nodes=5, max_depth=2)


def test_a_good_tree_passes_validation() -> None:
    validate_tree(TREE, vocab_size=300, max_nodes=6, max_depth=3)


def test_rejection_rule_and_trees_off_verify_the_first_chain() -> None:
    """The rejection rule here preserves the distribution for one chain only: a tree is
    cut to its first chain before the pass (and so is every tree with trees off)."""
    draft = Draft(TREE.ids, None, TREE.parents)
    for accept, mode in (("rejection", "auto"), ("coupled", "off")):
        cut = checked_draft(draft, 300, 3, accept, mode)
        assert cut.ids == (5, 6, 7) and cut.parents is None
    assert checked_draft(draft, 300, 3, "coupled", "auto") == draft
    with pytest.raises(TreeError, match="beyond the budget of 2"):
        checked_draft(draft, 300, 2, "coupled", "auto")
    # a chain past the target's vocabulary is a padded draft model's: verified, rejected there
    assert checked_draft(Draft((5, 350)), 300, 2, "coupled", "auto").ids == (5, 350)


# ----------------------------------------------------------------------------- the pass


def chain_rows(model, committed: list[int], path_ids: list[int]) -> mx.array:
    """Reference: the rows a fresh chain pass gives over [last, *path_ids]."""
    caches = make_caches(model.n_layers)
    model(mx.array([committed[:-1]]), cache=caches)
    return model(mx.array([[committed[-1], *path_ids]]), cache=caches)[0]


def test_tree_rows_equal_chain_rows_and_the_gather_keeps_the_path(target: LoadedModel) -> None:
    model = target.model
    committed = [3, 17, 42, 8, 99, 5, 11]
    caches = make_caches(model.n_layers)
    model(mx.array([committed[:-1]]), cache=caches)
    start = cache_length(caches)
    logits = tree_pass(model, caches, committed[-1], TREE)
    mx.eval(logits)
    # verify-pass memory: the newest token's row and one row per node, nothing more
    assert cache_length(caches) == start + 1 + len(TREE)
    for leaf in (2, 4, 5):
        path = TREE.path(leaf)
        ref = chain_rows(model, committed, [TREE.ids[j] for j in path])
        got = logits[mx.array([0, *(1 + j for j in path)])]
        assert mx.allclose(got, ref, atol=1e-4).item(), f"path to node {leaf}"
    # accept the path 0 -> 3 -> 4: the cache now holds exactly that chain's rows
    commit_path(model, caches, start, [0, 3, 4])
    assert cache_length(caches) == start + 4
    nxt = model(mx.array([[2]]), cache=caches)[0, -1]
    ref_caches = make_caches(model.n_layers)
    ref = model(mx.array([[*committed, 5, 8, 9, 2]]), cache=ref_caches)[0, -1]
    assert mx.allclose(nxt, ref, atol=1e-4).item()


def test_a_chain_takes_the_causal_pass(target: LoadedModel) -> None:
    model = target.model
    committed = [3, 17, 42]
    chain = DraftTree.chain([9, 8])
    caches = make_caches(model.n_layers)
    model(mx.array([committed[:-1]]), cache=caches)
    got = tree_pass(model, caches, committed[-1], chain)
    assert mx.allclose(got, chain_rows(model, committed, [9, 8]), atol=1e-5).item()


@pytest.mark.parametrize("shape", [TREE, DraftTree.chain([9, 8, 7])], ids=["tree", "chain"])
def test_a_padded_pass_gives_the_same_rows_and_keeps_the_same_path(target: LoadedModel,
                                                                   shape: DraftTree) -> None:
    """Padding rows (a wider pass that costs less) change no node's row, and the gather
    drops them with the rejected rows."""
    model = target.model
    committed = [3, 17, 42, 8, 99, 5, 11]
    results = []
    for width in (0, 1 + len(shape) + 5):
        caches = make_caches(model.n_layers)
        model(mx.array([committed[:-1]]), cache=caches)
        start = cache_length(caches)
        logits = tree_pass(model, caches, committed[-1], shape, width)
        mx.eval(logits)
        assert logits.shape[0] == 1 + len(shape)
        assert cache_length(caches) == start + max(width, 1 + len(shape))
        path = shape.path(shape.first_chain() - 1)
        commit_path(model, caches, start, path)
        assert cache_length(caches) == start + 1 + len(path)
        nxt = model(mx.array([[2]]), cache=caches)[0, -1]
        results.append((logits, nxt))
    (plain, plain_next), (padded, padded_next) = results
    assert mx.allclose(padded, plain, atol=1e-4).item()
    assert mx.allclose(padded_next, plain_next, atol=1e-4).item()


# ----------------------------------------------------------------------------- the walk


@st.composite
def trees(draw: st.DrawFn, vocab: int) -> DraftTree:
    """Random valid trees: each node hangs under a node on the path to the previous one."""
    n = draw(st.integers(1, 9))
    ids: list[int] = []
    parents: list[int] = []
    stack: list[int] = []
    for i in range(n):
        depth = draw(st.integers(0, len(stack)))
        del stack[depth:]
        p = stack[-1] if stack else ROOT
        used = {ids[j] for j in range(i) if parents[j] == p}
        free = [t for t in range(vocab) if t not in used]
        if not free:
            break
        ids.append(draw(st.sampled_from(free)))
        parents.append(p)
        stack.append(i)
    return DraftTree(tuple(ids), tuple(parents))


def plain_sample(logits_row: mx.array, params: SamplingParams, position: int) -> int:
    """What plain decoding commits at `position` from one row (one-row sampler call)."""
    rows = coupled_rows(logits_row[None], params, None, [position])
    return int(rows.tokens[0].item())


@settings(max_examples=60, deadline=None)
@given(tree=trees(6), seed=st.integers(0, 2**31 - 1), temp=st.sampled_from([0.0, 0.8]),
       sharp=st.floats(0.5, 6.0), t0=st.integers(1, 500))
def test_coupled_walk_commits_what_plain_decoding_commits(tree: DraftTree, seed: int,
                                                         temp: float, sharp: float,
                                                         t0: int) -> None:
    """Over random trees and random target rows: each committed token is plain decoding's
    sample at its position from the row of the path before it; the walk stops only where
    no child holds that sample; and it never commits less than its first chain would."""
    rng = np.random.default_rng(seed)
    logits = mx.array(rng.normal(size=(len(tree) + 1, 6)).astype(np.float32) * sharp)
    params = SamplingParams(temperature=temp, seed=seed)
    context = list(range(t0))
    verdict = verify_tree_coupled(logits, tree, context, params)
    row = 0
    for depth, node in enumerate(verdict.path):
        assert tree.ids[node] == plain_sample(logits[row], params, t0 + depth)
        assert tree.parents[node] == (ROOT if depth == 0 else verdict.path[depth - 1])
        row = 1 + node
    n = len(verdict.path)
    assert verdict.token == plain_sample(logits[row], params, t0 + n)
    last = verdict.path[-1] if verdict.path else ROOT
    assert verdict.token not in [tree.ids[c] for c in tree.children.get(last, ())]
    k = tree.first_chain()
    chain = verify_coupled_logits(logits[: k + 1], params, None, tree.ids[:k], t0)
    assert n >= chain.n_accepted
    if tree.is_chain:
        assert (n, verdict.token) == (chain.n_accepted, chain.token)


def test_walk_negative_control() -> None:
    """A tree whose every first-level token differs from the target's sample accepts none."""
    logits = mx.array([[0.0, 9.0, 0.0, 0.0]] * 4)
    params = SamplingParams(temperature=0.0)
    verdict = verify_tree_coupled(logits[:3], DraftTree((0, 2), (-1, -1)), [1], params)
    assert verdict.path == () and verdict.token == 1
    verdict = verify_tree_coupled(logits, DraftTree((0, 1, 1), (-1, -1, 1)), [1], params)
    assert verdict.path == (1, 2) and verdict.token == 1


# ----------------------------------------------------------------------------- sources, policy


def test_prompt_lookup_branches_where_earlier_matches_diverge() -> None:
    drafter = NgramDrafter(min_n=2)
    # "1 2" was followed by "3 4 5" long ago and by "7 8 9" more recently
    context = [1, 2, 3, 4, 5, 0, 1, 2, 7, 8, 9, 0, 1, 2]
    draft = drafter.propose_tree(context, 3, EXTRA_NODES)
    tree = draft.tree
    validate_tree(tree, 300, 3 + EXTRA_NODES, 3)
    assert tree.ids[: tree.first_chain()] == (7, 8, 9)  # the most recent match first
    assert tree.ids == (7, 8, 9, 3, 4, 5) and tree.parents == (-1, 0, 1, -1, 3, 4)
    # the chain follows "0 1 2", the branch only "1 2": a gap of 1 (the chain's nodes have none)
    assert draft.gaps == (None, None, None, 1.0, 1.0, 1.0)
    # as long a match as the chain's: gap 0
    assert drafter.propose_tree([0, 1, 2, 3, 4, 5, 0, 1, 2, 7, 8, 9, 0, 1, 2], 3,
                                EXTRA_NODES).gaps == (None,) * 3 + (0.0,) * 3
    assert drafter.propose_tree(context, 3, 0).parents is None  # no budget: the chain
    assert drafter.propose_tree(context, 3, 2).ids == (7, 8, 9, 3, 4)
    # one continuation only: a chain
    assert drafter.propose_tree([1, 2, 3, 4, 1, 2], 2, EXTRA_NODES).parents is None


def test_prompt_lookup_branches_follow_the_last_token_alone() -> None:
    """"1 2" occurred once (then "3 4 0"); the token "2" alone also led to "8 9 0": that
    earlier continuation becomes a branch, though it is no match for the main chain."""
    context = [5, 2, 8, 9, 0, 1, 2, 3, 4, 0, 1, 2]
    tree = NgramDrafter().propose_tree(context, 3, EXTRA_NODES).tree
    assert tree.ids == (3, 4, 0, 8, 9, 0) and tree.parents == (-1, 0, 1, -1, 3, 4)
    # one token of match ("2") against the chain's three ("0 1 2"): a gap of 2
    assert NgramDrafter().propose_tree(context, 3, EXTRA_NODES).gaps == (None,) * 3 + (2.0,) * 3
    # negative control: branches from two-token suffixes only
    assert NgramDrafter(branch_min_n=2).propose_tree(context, 3, EXTRA_NODES).parents is None
    # a main chain of two-token suffixes only needs two tokens of match
    assert NgramDrafter(min_n=2).match([5, 2, 8, 9, 0, 7, 2], 3) == ()


def test_prune_keeps_a_tree_only_when_its_rows_pay() -> None:
    flat = CostModel({1: 1.0, 17: 1.0})  # extra rows free: every node pays
    steep = CostModel({1: 1.0, 17: 9.0})  # half a pass per extra row: none pays
    assert prune_tree(TREE, 0.5, 0.5, flat) == TREE
    # no extra row pays, but within the chain's three rows the depth-1 runner-up (arrives
    # 0.25) beats the chain's third node (0.125): it takes that row
    assert prune_tree(TREE, 0.5, 0.5, steep) == CHAIN_WIDTH
    # negative control: a runner-up that rarely wins keeps the chain
    assert prune_tree(TREE, 0.5, 0.2, steep) == DraftTree.chain(TREE.ids[:3])
    # a middle cost: the shallow fork (depth 1, arrives 0.3) takes the chain's third row
    # (0.125), and the deeper fork (0.15) is not worth a fifth row
    mid = CostModel({1: 1.0, 4: 1.0, 5: 1.08, 17: 3.0})
    assert prune_tree(TREE, 0.5, 0.6, mid) == CHAIN_WIDTH


def test_prune_looks_past_a_step_in_the_cost_curve() -> None:
    """The first extra row costs a step (a BLAS kernel's row block) and the next ones
    nothing: alone it does not pay, all three together do. Pricing stops at the first
    row that does not pay would keep the chain."""
    step = CostModel({1: 1.0, 4: 1.0, 5: 1.1, 17: 1.1})
    assert prune_tree(TREE, 0.5, 0.5, step) == TREE
    # negative control: the same step with rows that keep costing after it
    steady = CostModel({1: 1.0, 4: 1.0, 5: 1.1, 17: 3.6})
    assert prune_tree(TREE, 0.5, 0.5, steady) == CHAIN_WIDTH


def test_prune_prices_the_tree_within_the_steps_row_budget() -> None:
    """From 6 rows on the curve is back at 1-row cost, so the whole tree (7 rows with the
    pending token) costs what its chain does, and all of it is kept. A step whose row
    budget stops at 4 rows cannot pad past the 5-row step, and keeps the chain."""
    dip = CostModel({1: 1.0, 4: 1.0, 5: 3.0, 6: 1.0, 16: 1.0})
    assert prune_tree(TREE, 0.5, 0.5, dip) == TREE
    assert prune_tree(TREE, 0.5, 0.5, dip, limit=4) == CHAIN_WIDTH
    assert prune_tree(TREE, 0.5, 0.5, dip, limit=7) == TREE


def test_tree_stats_learn_how_often_an_alternative_wins() -> None:
    stats = TreeStats()
    before = stats.alt.alpha
    for _ in range(5):
        stats.observe(TREE, (5,))  # the root's second child won
    assert stats.alt.alpha > before
    for _ in range(20):
        stats.observe(TREE, ())  # both root children lost
    assert stats.alt.alpha < before


def test_tree_stats_learn_how_often_a_contested_first_child_holds() -> None:
    """Root contested by a rival with gap 0 (node 5), node 0 by one with gap 2 (node 3)."""
    gaps = (None, None, None, 2.0, 2.0, 0.0)
    stats = TreeStats()
    close, far = stats.holds([0.0]), stats.holds([2.0])
    assert close < far and stats.holds([None]) is None
    for _ in range(10):
        stats.observe(TREE, (), gaps)  # the root's first child lost to nobody
    assert stats.holds([0.0]) < close and stats.holds([2.0]) == far
    for _ in range(40):
        stats.observe(TREE, (0, 1), gaps)  # both first children held
    assert stats.holds([0.0]) > close and stats.holds([2.0]) > far
    # unscored rivals teach nothing here, and a chain is no contest
    lone = TreeStats()
    lone.observe(TREE, (), None)
    lone.observe(DraftTree.chain((5, 6, 7)), (0, 1, 2))
    assert lone.holds([0.0]) == close and lone.holds([2.0]) == far


def test_prune_prices_a_contested_node_by_how_often_its_first_child_holds() -> None:
    """A branch under a contested node: with the chain's 90% acceptance standing for the
    first child there, its sibling rarely gets a turn and the row does not pay; where
    contested first children were learned to hold 40% of the time, it does. The pricing
    is the arrival chance of each node, checked against the product by hand."""
    tree = DraftTree((5, 6, 7, 4, 8), (-1, 0, 1, -1, 3))  # root contested: 5 vs 4
    reach = arrival(tree, 0.9, [0.6] * 5, {ROOT: 0.4})
    assert reach == pytest.approx([0.4, 0.4 * 0.9, 0.4 * 0.81, 0.6 * 0.6, 0.36 * 0.9])
    one_row = CostModel({1: 1.0, 4: 1.0, 5: 1.1, 6: 1.2, 17: 3.0})
    assert prune_tree(tree, 0.9, 0.6, one_row) == DraftTree.chain((5, 6, 7))
    assert prune_tree(tree, 0.9, 0.6, one_row, held=0.4) == tree
    # the same through a drafter's gaps: a close rival (gap 0) after a run of lost contests
    stats = TreeStats()
    for _ in range(30):
        stats.observe(tree, (3, 4), (None, None, None, 0.0, 0.0))
    draft = Draft(tree.ids, None, tree.parents, (None, None, None, 0.0, 0.0))
    # the learned contests were lost so often that the runner-up's branch takes the
    # chain's deeper rows: 5 4 8 in the chain's width
    assert prune_draft(draft, 0.9, stats, one_row).ids == (5, 4, 8)
    assert prune_draft(Draft(tree.ids, None, tree.parents), 0.9, TreeStats(),
                       one_row).ids == (5, 6, 7)


# chain 5 6 7; a depth-2 leaf (8) that came close and a depth-1 leaf (4) that did not
SCORED = Draft((5, 6, 7, 8, 4), None, (-1, 0, 1, 0, -1), (None, None, None, 0.1, 5.0))


def test_tree_stats_learn_per_gap_band() -> None:
    stats = TreeStats()
    close, far, unscored = stats.chance(0.1), stats.chance(5.0), stats.chance(None)
    assert close > far  # the prior already trusts a close call more
    for _ in range(10):
        stats.observe(SCORED.tree, (0, 3), SCORED.gaps)  # the close call at depth 2 won
        stats.observe(SCORED.tree, (), SCORED.gaps)  # the far one at depth 1 lost
    assert stats.chance(0.1) > close and stats.chance(5.0) < far
    assert stats.chance(None) == unscored  # scored leaves say nothing of unscored ones


def test_prune_spends_the_budget_on_the_closest_call() -> None:
    """One extra row pays here. Priced alike, the shallower leaf wins it; priced by their
    gaps, the close call one level deeper beats a distant guess at depth 1."""
    one_row = CostModel({1: 1.0, 4: 1.0, 5: 1.03, 6: 1.2, 17: 3.0})
    alike = prune_tree(SCORED.tree, 0.5, ALT_PRIOR, one_row)
    assert alike == DraftTree((5, 6, 7, 4), (-1, 0, 1, -1))
    scored = prune_draft(SCORED, 0.5, TreeStats(), one_row)
    assert scored.ids == (5, 6, 7, 8) and scored.parents == (-1, 0, 1, 0)
    assert scored.gaps == (None, None, None, 0.1)
    # without gaps the same draft is priced alike
    assert prune_draft(Draft(SCORED.ids, None, SCORED.parents), 0.5, TreeStats(),
                       one_row).ids == alike.ids


def test_the_feature_tap_keeps_the_accepted_path_rows() -> None:
    """The trained head reads the target's states by position: after a tree's pass the
    tap's rows get the same gather as the cache."""
    from engine.models.taps import FeatureTap

    tap = FeatureTap([0], owner=None)
    rows = mx.arange(10, dtype=mx.float32)[:, None]  # position p holds the value p
    tap.record(0, {0: rows[None]})
    tap.compact(5, [0, 2, 3])
    assert tap.length == 8
    assert tap.rows(0, 8)[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 7, 8]
    tap.compact(3, [0, 1])  # a chain's prefix: a plain cut
    assert tap.rows(0, tap.length)[:, 0].tolist() == [0, 1, 2, 3, 4]


def test_lookup_knows_which_tokens_its_other_matches_continued_with() -> None:
    # "2" was followed by 8 (long ago) and by 3 (as "1 2", most recently)
    context = [5, 2, 8, 9, 0, 1, 2, 3, 4, 0, 1, 2]
    drafter = NgramDrafter()
    assert drafter.continued_with(context, 3)  # the main match's own token
    assert drafter.continued_with(context, 8)  # a first-layer branch's
    assert not drafter.continued_with(context, 9)
    assert not NgramDrafter(branch_min_n=2).continued_with(context, 8)


def test_a_row_priced_like_the_chain_must_bring_more_than_the_margin() -> None:
    """16 and 17 rows priced alike (a monotone table does that). Beside a 15-token chain
    (about 10.4 tokens expected at 95%), a runner-up at depth 15 that arrives 0.24% of the
    time gets the row (+0.24 / 10.4 = 0.24% tokens/s, over ROW_MARGIN); one that arrives
    0.024% of the time does not (+0.02%), though it is free on the table."""
    chain = tuple(range(10, 25))
    tree = DraftTree((*chain, 99), (*range(-1, 14), 13))  # a runner-up beside node 14
    flat = CostModel({1: 1.0, 16: 1.5, 17: 1.5, 32: 3.0})
    # the runner-up arrives 0.95^14 (its parent) x 0.05 (the chain's node lost) x alt
    assert arrival(tree, 0.95, [1.0] * 16)[15] == pytest.approx(0.95 ** 14 * 0.05)
    assert prune_tree(tree, 0.95, 1.0, flat) == tree
    assert prune_tree(tree, 0.95, 0.1, flat) == DraftTree.chain(chain)


# chain 5 6 7 the drafter was sure of; a depth-1 runner-up (4) it gave 30%, another (9) 2%
SURE = Draft((5, 6, 7, 4, 9), None, (-1, 0, 1, -1, -1), None, (0.65, 0.95, 0.95, 0.3, 0.02))


def test_tree_stats_calibrate_a_drafters_confidence_per_band() -> None:
    """Every node whose parent the walk reached says whether the drafter's confidence in
    it held; nodes past the walk say nothing. Negative control: bands no node fell in keep
    their prior."""
    stats = TreeStats()
    sure, guess, rare = stats.wins(0.95), stats.wins(0.3), stats.wins(0.02)
    assert sure > guess > rare  # the prior takes the drafter at its word
    for _ in range(20):
        stats.observe(SURE.tree, (3,), None, SURE.conf)  # the 30% runner-up won
    assert stats.wins(0.3) > 0.8 > guess  # it held every time it was reached
    assert stats.wins(0.65) < 0.2  # the chain's first node lost every time
    assert stats.wins(0.95) == sure  # the chain's deeper nodes were never reached
    assert stats.wins(0.02) < rare and stats.wins(0.45) == TreeStats().wins(0.45)


def test_prune_prices_each_node_by_its_calibrated_confidence() -> None:
    """Priced by the drafter's confidence, the 30% runner-up is worth a row and the 2% one
    is not, and on a steeper curve neither is. Once the calibration has seen 30% picks
    win and 65% ones lose, the runner-up takes the chain's deepest row there."""
    curve = CostModel({1: 1.0, 4: 1.0, 5: 1.05, 6: 1.2, 17: 3.0})
    kept = prune_draft(SURE, 0.5, TreeStats(), curve)
    assert kept.ids == (5, 6, 7, 4) and kept.conf == (0.65, 0.95, 0.95, 0.3)
    steep = CostModel({1: 1.0, 4: 1.0, 5: 1.13, 6: 1.3, 17: 3.0})
    assert prune_draft(SURE, 0.5, TreeStats(), steep).ids == (5, 6, 7)
    learned = TreeStats()
    for _ in range(20):
        learned.observe(SURE.tree, (3,), None, SURE.conf)
    turned = prune_draft(SURE, 0.5, learned, steep)
    assert turned.ids == (5, 6, 4) and turned.parents == (-1, 0, -1)


def test_a_chain_goes_deeper_only_while_its_calibrated_arrival_pays() -> None:
    """A draft step costs a tenth of a pass here and a row little: a chain the drafter is
    sure of goes on, one it gave 10% stops at once, and one it was sure of but whose
    band the calibration learned to distrust stops too (negative control: the same
    confidences before that)."""
    costs = CostModel({1: 1.0, 4: 1.05}, {"model": 0.1})
    stats = TreeStats()
    more = deeper_pays(stats, 0.6, costs, 0.1, 3)
    assert more([0.95]) and more([0.95, 0.9])
    assert not more([0.1]) and not more([0.95, 0.1])
    for _ in range(60):
        stats.observe(DraftTree.chain((5,)), (), None, (0.95,))  # sure, and wrong
    assert not deeper_pays(stats, 0.6, costs, 0.1, 3)([0.95])
