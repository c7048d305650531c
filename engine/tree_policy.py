"""Whether a draft tree pays over its chain, and how much of it: from the cost curve.

A tree's extra nodes widen the verify pass. On this CPU width 8 costs about 1.3-1.5x
width 1, so a second candidate at a shallow depth is often worth its row and a deep bushy
tree is not. Expected committed tokens are computable per node: each node's chance to be
accepted is its parent's times the chance it wins there. A first child wins with the
chain's acceptance a, or — where rivals with a score gap stand beside it, a *contested*
node — with h, learned from verified trees per gap band of the closest rival: a close
rival means the drafter itself was unsure, and there its pick is right far less often than
on average (prompt lookup on code edits: 57% at depth 1 where an earlier match continued
differently, against 92% where they agreed). Any other child wins with (1 - h) b, b the
chance it is right when its older sibling was wrong. `prune_tree` ranks nodes by that
chance and keeps the shape with the most expected tokens per second: the main chain plus
the extra nodes that pay (a chain when none does), or the best-arriving nodes wherever they
are, at the chain's width or wider. `TreeStats` learns h and b.

A runner-up carries its score gap: how far below the chain's token it scored. For a
model drafter, under the same coupled noise (at T = 0, the log-ratio of their draft
probabilities); for prompt lookup, how many tokens shorter the earlier match it copies is
than the chain's (a match as long as the chain's is a real fork in the text, one token of
match is a guess). A close call is a likelier win than a distant one (EAGLE-2's point:
the draft's own confidence predicts acceptance), so b is learned per gap band, per
drafter, and the budget goes to the close calls at whatever depth they are.

A model drafter (a draft model, the trained head) says more than a gap: its own chance for
every node (`Draft.conf`). Each node is then priced by that chance, calibrated per
drafter from the nodes verified so far (`TreeStats.wins`), and the drafter stops drafting
deeper where its chain's calibrated arrival no longer pays for another draft step
(`deeper_pays`): with the demo's two-hour head at T = 0, first-depth picks it gave under
20% (a fifth of its steps) were accepted 3% of the time and picks over 90% nearly always,
where one acceptance estimate priced them alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from engine.drafters.base import Draft
from engine.tree import ROOT, DraftTree
from engine.tuning import K_MAX, AcceptanceEstimate, CostModel

ALT_PRIOR = 0.35  # prior chance an alternative child is right after its sibling missed
# prior chance a contested node's first child wins, by the gap band of its closest rival
HELD_PRIORS = (0.55, 0.7, 0.8, 0.9)
# score-gap bands of a runner-up (upper edges) and the prior chance it wins in each
GAP_EDGES = (0.5, 1.5, 3.0)
GAP_PRIORS = (0.45, 0.3, 0.15, 0.05)
# how much more expected tokens per second a wider tree must promise to be kept: every row
# costs something (a wider pass, the tree's mask, the path's gather) even where the cost
# table, noisy and made monotone, prices two widths alike. A tenth of a percent refuses a
# node that arrives 0.5% of the time beside a 15-token chain; 1% also refused the
# runner-ups of a 4-token model draft at T = 0.8, a few percent each, that do pay
ROW_MARGIN = 0.001
# confidence bands of a model drafter's node (upper edges); the prior chance a node in each
# wins where its parent is reached is the band's middle, until verified nodes say otherwise
CONF_EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
CONF_PRIORS = (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95)


def gap_band(gap: float) -> int:
    """Which `GAP_EDGES` band a runner-up's score gap falls in."""
    return sum(gap >= edge for edge in GAP_EDGES)


def conf_band(conf: float) -> int:
    """Which `CONF_EDGES` band a model drafter's confidence in a node falls in."""
    return sum(conf >= edge for edge in CONF_EDGES)


@dataclass
class TreeStats:
    """How often a contested node's first child won (`held`, per gap band of its closest
    scored rival), and how often an alternative child was accepted where the first child
    was rejected: per score-gap band for runner-ups that carry a gap, one figure for those
    that do not. For a drafter that states its confidence in each node, how often a node
    won where its parent was reached, per confidence band (`by_conf`)."""

    alt: AcceptanceEstimate = field(default_factory=lambda: AcceptanceEstimate(ALT_PRIOR))
    held: list[AcceptanceEstimate] = field(
        default_factory=lambda: [AcceptanceEstimate(p) for p in HELD_PRIORS])
    by_gap: list[AcceptanceEstimate] = field(
        default_factory=lambda: [AcceptanceEstimate(p) for p in GAP_PRIORS])
    by_conf: list[AcceptanceEstimate] = field(
        default_factory=lambda: [AcceptanceEstimate(p) for p in CONF_PRIORS])
    trees: int = 0

    def wins(self, conf: float) -> float:
        """The chance a node the drafter gave `conf` wins where its parent is reached."""
        return self.by_conf[conf_band(conf)].alpha

    def chance(self, gap: float | None) -> float:
        """The chance an alternative child with this score gap wins where its older
        sibling lost."""
        return self.alt.alpha if gap is None else self.by_gap[gap_band(gap)].alpha

    def holds(self, gaps: Sequence[float | None]) -> float | None:
        """The chance a first child wins beside rivals with these gaps (None: no rival
        carries one, and the chain's acceptance stands)."""
        scored = [g for g in gaps if g is not None]
        return self.held[gap_band(min(scored))].alpha if scored else None

    def observe(self, tree: DraftTree, path: tuple[int, ...],
                gaps: Sequence[float | None] | None = None,
                conf: Sequence[float] | None = None) -> None:
        """One verified tree: with confidences, did each node whose parent the walk
        reached win; else at each node the walk reached with several children, did the
        first win (beside rivals with a score gap), and where it lost, did another (which
        one, for children with a score gap)?"""
        self.trees += not tree.is_chain
        if conf is not None:
            reached = {ROOT, *path}
            for i, p in enumerate(tree.parents):
                if p in reached:
                    self.by_conf[conf_band(conf[i])].update(1, int(i in reached))
            return
        if tree.is_chain:
            return
        children = tree.children
        node = ROOT
        for depth in range(len(path) + 1):
            kids = children.get(node, ())
            taken = path[depth] if depth < len(path) else None
            rivals = [gaps[kid] for kid in kids[1:]] if gaps is not None else []
            if any(g is not None for g in rivals):
                closest = min(g for g in rivals if g is not None)
                self.held[gap_band(closest)].update(1, int(taken == kids[0]))
            if len(kids) > 1 and taken != kids[0]:
                scored = [kid for kid in kids[1:] if gaps is not None and gaps[kid] is not None]
                for kid in scored:
                    self.by_gap[gap_band(gaps[kid])].update(1, int(taken == kid))
                if len(scored) < len(kids) - 1:
                    self.alt.update(1, int(taken is not None and taken not in scored))
            if taken is None:
                break
            node = taken


def deeper_pays(stats: TreeStats, alpha: float, costs: CostModel, draft_s: float,
                k: int) -> Callable[[Sequence[float]], bool]:
    """Whether a model drafter that drew a chain with these confidences should draft one
    node deeper (up to the policy's `k`): the next node adds its arrival — the chain's
    calibrated arrival so far times `alpha`, the chance a next node wins — in tokens
    worth a plain pass each, and costs a draft step and a verify row (the average row of
    a `k`-draft pass). A chain the drafter is unsure of stops early, saving the steps
    and rows its deep nodes would have taken for the few tokens they bring."""
    row = max(costs.verify(k + 1) - costs.verify(1), 0.0) / max(k, 1)
    gain, price = alpha * costs.verify(1), draft_s + row

    def more(confs: Sequence[float]) -> bool:
        reach = 1.0
        for c in confs:
            reach *= stats.wins(c)
        return reach * gain > price

    return more


def prune_tree(tree: DraftTree, alpha: float, alt: float, costs: CostModel | None,
               draft_s: float = 0.0, limit: int = K_MAX + 1,
               held: float | None = None) -> DraftTree:
    """The subtree with the best expected tokens per second: the main chain plus the
    branch nodes that pay for their rows (a chain when none does), every alternative child
    priced alike (`alt`: its chance to win where its older sibling lost). Widths are
    priced as they will run under a row budget of `limit` (`CostModel.verify`)."""
    chances = [alt] * len(tree)
    holds = None if held is None else {p: held for p, kids in tree.children.items()
                                       if len(kids) > 1}
    return subtree(tree, kept_nodes(tree, alpha, chances, costs, draft_s, limit, holds))


def prune_draft(draft: Draft, alpha: float, stats: TreeStats, costs: CostModel | None,
                draft_s: float = 0.0, limit: int = K_MAX + 1) -> Draft:
    """`prune_tree` for a drafter's tree, each node priced by the drafter's confidence in it
    where it states one, else each branch by its score gap where it has one and each
    contested node by what `stats` learned of them; the kept nodes keep their gaps and
    confidences (for `TreeStats.observe`). q is dropped: trees are verified under the
    coupled rule, which does not read it."""
    tree = draft.tree
    gaps = draft.gaps or (None,) * len(tree)
    if draft.conf is not None:
        kept = paying_nodes(tree, reaches(tree, [stats.wins(c) for c in draft.conf]), costs,
                            draft_s, limit)
    else:
        holds = {p: stats.holds([gaps[kid] for kid in kids[1:]])
                 for p, kids in tree.children.items() if len(kids) > 1}
        kept = kept_nodes(tree, alpha, [stats.chance(g) for g in gaps], costs, draft_s,
                          limit, {p: h for p, h in holds.items() if h is not None})
    pruned = subtree(tree, kept)
    conf = None if draft.conf is None else tuple(
        c for i, c in enumerate(draft.conf) if i in kept)
    if pruned.is_chain:
        return Draft(pruned.ids, conf=conf)
    kept_gaps = tuple(g for i, g in enumerate(gaps) if i in kept)
    return Draft(pruned.ids, None, pruned.parents, kept_gaps, conf)


def arrival(tree: DraftTree, alpha: float, chances: Sequence[float],
            holds: Mapping[int, float] | None = None) -> list[float]:
    """Each node's chance to be accepted: its parent's times its chance to win there —
    for the first child of node p, `holds[p]` where given (p contested), else `alpha`;
    for any later child i, (1 - that) * chances[i]."""
    holds = holds or {}
    children = tree.children
    wins = []
    for i, p in enumerate(tree.parents):
        first_wins = holds.get(p, alpha)
        wins.append(first_wins if children[p][0] == i else (1 - first_wins) * chances[i])
    return reaches(tree, wins)


def reaches(tree: DraftTree, wins: Sequence[float]) -> list[float]:
    """Each node's chance to be accepted: its parent's times `wins[i]`, its chance to win
    where its parent is reached (parents come first in depth-first order)."""
    out: list[float] = []
    for i, p in enumerate(tree.parents):
        out.append((1.0 if p == ROOT else out[p]) * wins[i])
    return out


def kept_nodes(tree: DraftTree, alpha: float, chances: Sequence[float],
               costs: CostModel | None, draft_s: float = 0.0,
               limit: int = K_MAX + 1, holds: Mapping[int, float] | None = None) -> set[int]:
    """The nodes worth their rows (each with its parent kept), the main chain always among
    them; `chances[i]`: the chance node i wins where its older sibling lost; `holds[p]`:
    the chance contested node p's first child wins (see `arrival`)."""
    return paying_nodes(tree, arrival(tree, alpha, chances, holds), costs, draft_s, limit)


def paying_nodes(tree: DraftTree, reach: Sequence[float], costs: CostModel | None,
                 draft_s: float = 0.0, limit: int = K_MAX + 1) -> set[int]:
    """The nodes worth their rows, node i arriving with chance `reach[i]`, the main chain
    (the policy's K, or less where the drafter stopped early) always among them.

    Two shapes are priced, and the faster kept: the main chain plus the nodes that pay,
    and the best-arriving nodes wherever they are, at least as many as the main chain.
    The second is why a tree is worth more than its chain plus extras: where the drafter
    was unsure near the root (a contested node), the main chain's deep nodes arrive less
    often than a runner-up's first few, and a pass that trades the one for the other is
    no wider."""
    n_main = tree.first_chain()
    if n_main == len(tree) or costs is None:
        return set(range(len(tree)))

    def best_prefix(order: Sequence[int], kept: int) -> tuple[float, int]:
        """(rate, n): the prefix of `order`, at least `kept` long, with the most expected
        tokens per second."""
        tokens = 1.0 + sum(reach[i] for i in order[:kept])
        best = (tokens / (n_main * draft_s + costs.verify(kept + 1, limit)), kept)
        for n in range(kept + 1, len(order) + 1):
            tokens += reach[order[n - 1]]
            rate = tokens / (n_main * draft_s + costs.verify(n + 1, limit))
            if rate > best[0] * (1 + ROW_MARGIN):
                best = (rate, n)
        return best

    # a child never arrives more often than its parent, and a parent comes first in DFS
    # order, so both rankings keep every node's parent ahead of it. Every prefix is
    # priced, not only until the first row that does not pay: the cost curve has steps
    # (a BLAS kernel's row blocking, a GPU's SIMD width), so a row that costs a step can
    # open several that cost nothing
    by_reach = sorted(range(len(tree)), key=lambda i: (-reach[i], i))
    main_first = [*range(n_main), *(i for i in by_reach if i >= n_main)]
    anchored, n_anchored = best_prefix(main_first, n_main)
    free, n_free = best_prefix(by_reach, n_main)
    if free > anchored:
        return set(by_reach[:n_free])
    return set(main_first[:n_anchored])


def subtree(tree: DraftTree, kept: set[int]) -> DraftTree:
    """The nodes in `kept` (each with its parent kept), renumbered in the same DFS order."""
    new_index: dict[int, int] = {ROOT: ROOT}
    ids: list[int] = []
    parents: list[int] = []
    for i, (tok, p) in enumerate(zip(tree.ids, tree.parents, strict=True)):
        if i in kept and p in new_index:
            new_index[i] = len(ids)
            ids.append(tok)
            parents.append(new_index[p])
    return DraftTree(tuple(ids), tuple(parents))
