"""Choosing the draft length K (and, in auto mode, the drafter) for each step.

A step with K drafts costs K draft tokens plus one target pass of width K+1, and commits
on average (1 - a^(K+1)) / (1 - a) tokens when each draft is accepted with probability a.
We measure the costs once per model/drafter/backend (`engine.calibration`, cached in the
app-data dir) and correct them with every timed pass, keep a running acceptance estimate
per drafter, and pick the K with the most tokens per second — K = 0 (a plain step) when
drafting does not pay.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tree_policy builds on this module
    from engine.tree_policy import TreeStats

K_MAX = 15
# most nodes a draft tree may add beyond its main chain: enough for a K_MAX-deep runner-up
# (prompt lookup's earlier match that continues differently is often right to its end)
EXTRA_NODES = 16
WIDEST_PASS = 1 + K_MAX + EXTRA_NODES  # the pending token, a K_MAX chain, a full tree
PRIOR_ACCEPTANCE = {"model": 0.6, "layerskip": 0.3,
                    # prompt lookup, by matched suffix length: longer matches copy better
                    "ngram2": 0.1, "ngram3": 0.25, "ngram4": 0.55}
# a lookup match this long that the policy would draft is drafted, whatever another
# drafter's estimate says (`DraftPolicy`): the text is being copied
COPY_MATCH = 2
OPTIMISTIC_ACCEPTANCE = 0.8  # a drafter that cannot pay even at this rate is never probed
DRAFT_MARGIN = 0.15  # how much drafting must beat plain steps by, by the cost model ...
# ... once a drafter's steps have been timed against what the model priced them at
PROVEN_MARGIN = 0.03
OVERHEAD_MIN_STEPS = 4  # timed steps of a drafter before its overhead factor is used
OVERHEAD_RANGE = (0.8, 4.0)  # a drafter's factor, clamped
# a pass is padded to a wider width only when that width's pass is this much cheaper:
# less is within the noise of a timing, and a padded pass holds more cache rows
PAD_MARGIN = 0.05
COST_EMA = 0.2  # weight of a new timing in the running per-width cost
# ... and a timing of a multi-token width above its running cost counts as at most this
# much above it: on a shared machine ~1 pass in 10 runs 1.5-2x slow at any width, and a
# few such passes raised a width's price ~20%, so a head that drafts at that width sat out
# until a probe re-timed it. Width 1 is exempt: plain steps re-time it every step, and its
# lasting drifts rescale the whole curve (`CostModel._check_anchor`)
SLOW_CLIP = 0.3
DRIFT_FRACTION = 0.3  # a timing this far off the table (either way) says the table is stale
# after a correction, the rest of the table is one live timing's guess: a first timing
# this much under it refines it (a width's first pass often runs up to ~1.4x slow)
REFINE_FRACTION = 0.15
DRIFT_EMA = 0.05  # weight of one width-1 timing in the drift that rescales the table
PROBE_EVERY = 16  # steps without drafting before one probe with a short draft ...
# ... or more, so that such rechecks take about this share of decode time, priced at what
# the last one cost beyond plain steps committing its tokens (a head's recheck at ~10%
# acceptance cost ~0.5 of a pass: every 16 steps, auto lost 2-3% of chat to them)
RECHECK_SHARE = 0.01
COST_PROBES = True  # verify untested widths now and then (off only for a negative control)
PROBE_SHARE = 0.05  # cost probes may take about this share of decode time
PROBE_DRAFT_PASSES = 2.0  # a cost probe drafts at most this many target passes' worth
USEFUL_REACH = 0.05  # ... and no deeper than its drafts are reached this often
CONFIRM_TIMINGS = 2  # live timings of a width before probes take the table's word for it
GUARD_MIN_STEPS = 32  # steps of a drafter before its realized speed can bench it
GUARD_SLACK = 0.03  # ... once it loses to plain steps by more than this, ...
# ... judged only while its record is this many steps old at most: a drafter the cost
# model already keeps off has a frozen record, and plain steps' fresh one, from a fast
# moment, benched a head that was winning for three replies
GUARD_FRESH = 2
REALIZED_DECAY = 0.97  # per step, of the seconds and tokens in a realized speed
OVERHEAD_DECAY = 0.9  # per step, of the seconds in a step overhead
# steps after which a benched drafter starts a fresh record: one 128-token reply at its
# first bench, so a drafter that lost on one kind of text is tried on the next, doubling
# with each bench in a row up to eight replies. A bench on a slow moment or a first
# reply's warm-up steps then costs one reply, not the three a fixed 384 cost (traced on
# held-out chat: a head at 48% acceptance benched at step 94 ran x1.12, x1.29-1.36 in the
# runs around it), while a drafter that keeps losing drafts 32 losing steps in ~1,000
GUARD_RETRY = 128
GUARD_RETRY_MAX = 1024
# a drafter that keeps a fresh record this long without a bench has won its place: its
# next bench starts from GUARD_RETRY again
GUARD_CLEAR_STEPS = 128


@dataclass
class CostModel:
    """Measured seconds: target pass by width, and one draft token per drafter.

    The table starts from a calibration (maybe cached from another day, another BLAS, a
    busy hour) and is corrected by every timed pass. A width timed in this process is
    *tested*. No width is priced above a wider one, since a pass can be padded to the
    wider width (`pad_width`), so one live pass of a wide width caps the price of every
    stale entry below it, and one far below the table rescales the other untested
    entries. When width-1 timings, which plain steps take all the time, drift (smoothed)
    from where the table was anchored by more than DRIFT_FRACTION, the whole curve is
    rescaled by that ratio and every other width counts as untested again (and gets
    probed: `DraftPolicy`).
    """

    verify_s: dict[int, float]
    draft_s: dict[str, float] = field(default_factory=dict)
    # what a step loses when it must read the pending token before building its pass: a
    # pipelined plain step builds the next pass while the last one finishes (about the
    # graph-building time of a width-1 pass)
    overlap_s: float = 0.0
    # widths whose entry no pass of their own set: a correction rescaled it from another
    # width's timing (kept in the calibration file, so a later run knows it too)
    inferred: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        # verify() for every width up to WIDEST_PASS, per row budget, rebuilt after a change
        # from one interpolated table: the policy asks for the whole curve every step, and
        # the step's host time competes with the pass
        self._raw: list[float] | None = None
        self._curves_by_limit: dict[int, tuple[list[float], list[int]]] = {}
        self._steps: list[float] | None = None  # `step_prices`, rebuilt after a change
        # widths timed live since the table was anchored (*tested*), and how many times
        self._timings: dict[int, int] = {}
        self._anchor = self.verify_s.get(1)  # the width-1 cost the table agrees with
        self._drift = 0.0  # smoothed log(width-1 timing / anchor)
        # whether a live timing has rescaled the untested entries since the anchor, and
        # the widths whose entry is one live timing taken whole by such a correction
        self._corrected = False
        self._taken_whole: set[int] = set()
        # what live timings changed, for the user: (width, table seconds, live seconds)
        self.corrections: list[tuple[int, float, float]] = []

    def observe(self, width: int, seconds: float) -> None:
        """Fold a measured pass into the table, so costs follow the machine's load.

        The first live timings of a width (until CONFIRM_TIMINGS) replace a table entry
        they undercut by more than DRIFT_FRACTION (that entry was timed some other time,
        or the first timing in a busy moment), and rescale the other untested entries
        wider than one token by the same ratio; other timings are smoothed (a slow one
        clipped to SLOW_CLIP over the running cost). Narrower
        ones too: capping them at the live timing alone would price a 2-token pass like
        the probed 7-token one, so short drafts would stay shut out until each width
        happened to be tried.

        Such a correction rests on one timing, and a width's first live pass often runs
        slow (up to ~1.4x its steady cost here), which would leave the whole table that
        much high. So until the next anchor rescale, the entries it set (the rescaled
        ones, and its own while timed once) are refined by any first timing more than
        REFINE_FRACTION under them, the same way: the passes the policy runs anyway fix
        the table, without another probe.
        """
        old = self.verify_s.get(width)
        taken_whole = False
        if self._timings.get(width, 0) < CONFIRM_TIMINGS:
            old = _table_cost(self._points(), width)  # what the table says for this width
            # only a cheaper pass is taken whole: a table too high keeps the policy from
            # ever timing that width again, one too low is corrected by the passes it
            # brings (and on a shared machine a single slow timing is often just load)
            refining = self._corrected and width > 1 and self._unsettled(width)
            margin = REFINE_FRACTION if refining else DRIFT_FRACTION
            if seconds * (1 + margin) < old:
                self.corrections.append((width, old, seconds))
                if width > 1:  # untested multi-token entries are likely off the same way
                    for w in self.verify_s:
                        if w > 1 and w != width and self._unsettled(w):
                            self.verify_s[w] *= seconds / old
                            self.inferred.add(w)
                    taken_whole = self._corrected = True
                old = seconds
            elif width in self.inferred and seconds > old * (1 + REFINE_FRACTION):
                # an entry another width's timing set, and this width's own first pass
                # says it is too low: taken whole too (alone). Else a noisy machine's fast
                # moments, each rescaling the untested entries down, ratchet them far
                # below any real pass (a 2-row pass priced at 0.27x a 1-row one was
                # saved here), and the policy drafts into rows it thinks are free
                self.corrections.append((width, old, seconds))
                old = seconds
            self.inferred.discard(width)  # its own pass has set it now
        if taken_whole:
            self._taken_whole.add(width)
        else:
            self._taken_whole.discard(width)
        if width > 1:
            seconds = slow_capped(seconds, old)
        self.verify_s[width] = old + COST_EMA * (seconds - old)
        self._timings[width] = self._timings.get(width, 0) + 1
        if width == 1:
            self._check_anchor(seconds)
        self._raw = None
        self._curves_by_limit.clear()
        self._steps = None

    def _unsettled(self, width: int) -> bool:
        """Whether the entry is no live evidence yet: never timed, or one timing that a
        correction took whole."""
        return width not in self._timings or width in self._taken_whole

    def _check_anchor(self, seconds: float) -> None:
        """Rescale the curve when width-1 timings have drifted from the table's anchor.

        The drift is a slow average of log(timing / anchor) (DRIFT_EMA), so one busy
        moment on a shared machine does not rescale the table; a lasting change does.
        """
        if self._anchor is None:
            self._anchor = self.verify_s[1]
            return
        self._drift += DRIFT_EMA * (math.log(max(seconds, 1e-9) / self._anchor) - self._drift)
        if abs(self._drift) <= math.log1p(DRIFT_FRACTION):
            return
        now = self.verify_s[1]
        ratio = now / self._anchor
        self.corrections.append((1, self._anchor, now))
        self.verify_s[1] = self._anchor
        self.verify_s = {w: sec * ratio for w, sec in self.verify_s.items()}
        self._anchor, self._drift = now, 0.0
        self._timings = {1: 1}
        self._corrected = False
        self._taken_whole.clear()

    def tested(self, width: int) -> bool:
        """Whether a pass this wide (or wider) has been timed since the table's anchor."""
        return any(w >= width for w in self._timings)

    def confirmed(self, width: int) -> bool:
        """Whether a pass this wide (or wider) has been timed CONFIRM_TIMINGS times.

        One timing that agrees with a stale table may be a busy moment (a pass several
        times slower than usual); were probes to stop there, that moment would lock the
        drafter out for good. A second probe, spaced by PROBE_SHARE, settles it.
        """
        return any(n >= CONFIRM_TIMINGS for w, n in self._timings.items() if w >= width)

    def verify(self, width: int, limit: int = K_MAX + 1) -> float:
        """Seconds for one target pass over `width` tokens, run at `pad_width(width,
        limit)`: a step whose row budget (`limit`) forbids the cheaper wider pass pays
        for its own width.

        Never less for a wider pass: noisy timings must not make drafting look free.
        """
        first, seconds = min(self._points())
        if width <= first:  # no narrower entry to pad to, none cheaper below it: as timed
            return seconds
        curve = self._curves(limit)[0]
        if 0 <= width < len(curve):
            return curve[width]
        return max(curve[-1], _table_cost(self._points(), width))

    def step_prices(self) -> list[float]:
        """`verify(w, row_budget(w - 1))` for w = 0 .. K_MAX + 1: each width's pass as a
        step drafting w - 1 tokens runs it, padded within that step's row budget.

        Why one list, built once per change: the policy prices every K for every drafter
        at every step, and the table changes at every step (each plain step times width
        1). Building a curve per row budget for that took ~0.5 ms a step, and on this
        2-core CPU the host's time is the pass's: `auto` on chat with nothing to draft ran
        ~5% behind plain decoding, x0.99-1.00 with the policy's work skipped.
        """
        if self._steps is None:
            self._steps = _step_prices(self._raw_costs())
        return self._steps

    def pad_width(self, width: int, limit: int = K_MAX + 1) -> int:
        """The width to run a pass of `width` rows at: the cheapest measured width from
        `width` to `limit` rows (the step's row budget, at most WIDEST_PASS) when it
        undercuts `width` itself by PAD_MARGIN, else `width`.

        Why: a BLAS's small-matrix kernels block rows (OpenBLAS here: 12 rows cost ~25%
        more than 16), so the padding rows of a wider pass are cheaper than the pass's own
        shape. Plain steps (width 1) are never padded. The padded rows are computed and
        then dropped with the rejected ones; the pass's timing is the padded width's.
        """
        pads = self._curves(limit)[1]
        return pads[width] if 0 <= width < len(pads) else width

    def _curves(self, limit: int) -> tuple[list[float], list[int]]:
        """(price, padded width) for widths 0..WIDEST_PASS under a row budget of `limit`:
        each width priced at its padded width's interpolated cost, then made
        non-decreasing."""
        limit = max(1, min(limit, WIDEST_PASS))
        curves = self._curves_by_limit.get(limit)
        if curves is None:
            raw = self._raw_costs()
            pads = _pads(raw, limit, WIDEST_PASS)
            curves = list(accumulate((raw[pad] for pad in pads), max)), pads
            self._curves_by_limit[limit] = curves
        return curves

    def _raw_costs(self) -> list[float]:
        """Each width's pass by the table (`_table_cost`), widths 0 .. WIDEST_PASS."""
        if self._raw is None:
            points = self._points()
            self._raw = [_table_cost(points, w) for w in range(WIDEST_PASS + 1)]
        return self._raw

    def table(self) -> dict[int, float]:
        """The table before padding: what a calibration file should say after live passes
        corrected it."""
        return dict(self._points())

    def _points(self) -> list[tuple[int, float]]:
        """The (width, seconds) table, sorted. Not made monotone: a dip at a wider width is
        what padding uses, and it prices every narrower width at most at the dip.

        A multi-token width not timed since the anchor follows width 1's smoothed drift:
        plain steps time width 1 all the time, and a table whose width 1 has eased 12%
        (within DRIFT_FRACTION) while its 2-token entry stayed put priced a 2-token pass
        at 1.34x a 1-token one instead of 1.18x, which kept a head that pays from ever
        running (and timing) one."""
        scale = math.exp(self._drift)
        return sorted((w, s * scale if w > 1 and w not in self._timings else s)
                      for w, s in self.verify_s.items())


def slow_capped(seconds: float, running: float) -> float:
    """A timing counted at most SLOW_CLIP over the running figure it updates: a slow moment
    on a shared machine must not move a price (or a factor) that only its own, now rarer,
    timings could move back."""
    return min(seconds, running * (1 + SLOW_CLIP))


def row_budget(k: int) -> int:
    """The most rows a verify pass of a K-token draft may take, padding included: the
    pending token, the K-deep main chain and EXTRA_NODES tree nodes. A step pads its pass
    only within it (`CostModel.pad_width`), so padding never grows the pass's memory past
    a tree's."""
    return min(1 + k + EXTRA_NODES, WIDEST_PASS)


def _pads(raw: list[float], limit: int, upto: int) -> list[int]:
    """The width each width 0 .. `upto` runs at under a row budget of `limit`: the
    narrowest of the cheapest widths from it up to the limit, where that undercuts its
    own by PAD_MARGIN (`CostModel.pad_width`)."""
    pads = list(range(upto + 1))
    cheapest = limit  # the narrowest of the cheapest widths from w up to the limit
    for w in range(limit, 1, -1):
        if raw[w] <= raw[cheapest]:
            cheapest = w
        if w <= upto and raw[cheapest] * (1 + PAD_MARGIN) < raw[w]:
            pads[w] = cheapest
    return pads


def _step_prices(raw: list[float]) -> list[float]:
    """`CostModel.step_prices` from the raw table: for each width, the highest padded
    price of the widths up to it, under that width's own step's row budget."""
    prices = []
    for width in range(K_MAX + 2):
        prices.append(max(raw[pad] for pad in _pads(raw, row_budget(width - 1), width)))
    return prices


def _table_cost(points: list[tuple[int, float]], width: int) -> float:
    """A pass of exactly `width` rows by the table: interpolated, and past its widest
    entry extrapolated from the table made non-decreasing."""
    return _interpolate(points if width <= points[-1][0] else _rising(points), width)


def _rising(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """`points` made non-decreasing (each at least the one before): for extrapolating
    past the table, where a dip's slope would price wide passes near zero."""
    highest = accumulate((sec for _, sec in points), max)
    return [(w, sec) for (w, _), sec in zip(points, highest, strict=True)]


def _interpolate(points: list[tuple[int, float]], width: int) -> float:
    """Piecewise-linear through `points`, extended past the last two."""
    if width <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (w0, s0), (w1, s1) in zip(points, points[1:], strict=False):
        if width <= w1:
            return s0 + (s1 - s0) * (width - w0) / (w1 - w0)
    (w0, s0), (w1, s1) = points[-2], points[-1]
    return s1 + (s1 - s0) / (w1 - w0) * (width - w1)


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens committed by a step with k drafts at per-token acceptance alpha."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, draft_s: float, costs: CostModel, k_max: int = K_MAX,
           pending: bool = False, guessed: bool = False,
           margin: float = DRAFT_MARGIN, overhead: float = 1.0,
           flat: bool = False) -> tuple[int, float]:
    """The K in [0, k_max] with the highest expected tokens/s, and that rate.

    `pending`: the target's logits for the next position are in flight, so drafting first
    reads that token and loses the overlap a pipelined plain step has (`overlap_s`).
    `guessed`: the draft begins with a guess of that pending token (prompt lookup), so its
    K further tokens are verified only when the guess was right (probability alpha); a
    wrong guess leaves a plain step. `overhead`: what the drafter's steps have been measured
    to take over their price here (`StepOverhead`). Drafting must also beat plain by
    `margin`, which covers what the model does not see. `flat`: every pass priced as a
    1-token one, the cheapest verify passes could be.
    """
    one = costs.verify(1)
    extra = costs.overlap_s if pending or guessed else 0.0
    # Every pass priced as a 1-token one first: no width costs less (the curve never
    # falls), so a drafter that cannot pay so is done with, without pricing the widths
    # (the usual answer for a drafter sitting out, every step)
    cheapest = _best_k(alpha, draft_s, None, one, k_max, extra, guessed, margin, overhead)
    if flat or cheapest[0] == 0:
        return cheapest
    return _best_k(alpha, draft_s, costs.step_prices(), one, k_max, extra, guessed, margin,
                   overhead)


def _best_k(alpha: float, draft_s: float, widths: list[float] | None, one: float, k_max: int,
            extra: float, guessed: bool, margin: float, overhead: float) -> tuple[int, float]:
    """`best_k` with a pass of width w priced `widths[w]` (a step with w - 1 drafts), or
    `one` at every width where `widths` is None."""
    plain = 1.0 / one
    best = (0, plain)
    for k in range(1, k_max + 1):
        width_s = one if widths is None else widths[k + 1]
        tokens, seconds = expected_tokens(alpha, k), (k * draft_s + width_s) * overhead
        if guessed:
            tokens = alpha * tokens + (1.0 - alpha)
            seconds = alpha * seconds + (1.0 - alpha) * one
        rate = tokens / (seconds + extra)
        if rate > best[1]:
            best = (k, rate)
    if best[0] and best[1] < plain * (1.0 + margin):
        return 0, plain
    return best


def useful_depth(alpha: float) -> int:
    """The deepest draft position a chain accepted at `alpha` per token still reaches
    USEFUL_REACH of the time: a cost probe deeper than that times a width the drafter
    would not use (a head at ~33% reaches depth 4 1% of the time, yet was probed at 16)."""
    if alpha <= 0.0:
        return 1
    if alpha >= 1.0:
        return K_MAX
    return max(1, min(K_MAX, math.ceil(math.log(USEFUL_REACH) / math.log(alpha))))


@dataclass
class AcceptanceEstimate:
    """Discounted counts of accepted vs first-rejected drafts (a geometric model)."""

    prior: float
    accepted: float = 0.0
    rejected: float = 0.0
    decay: float = 0.95
    weight: float = 4.0  # pseudo-observations the prior is worth

    @property
    def alpha(self) -> float:
        a = self.accepted + self.prior * self.weight
        return min(0.98, a / (a + self.rejected + (1 - self.prior) * self.weight))

    def update(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted <= 0:
            return
        self.accepted = self.accepted * self.decay + n_accepted
        self.rejected = self.rejected * self.decay + (1.0 if n_accepted < n_drafted else 0.0)


@dataclass
class DiscountedRatio:
    """A running ratio of two discounted sums (each step's values added, older ones worth
    `decay` less per step), and how many steps went in."""

    decay: float
    num: float = 0.0
    den: float = 0.0
    steps: int = 0

    @property
    def ratio(self) -> float:
        return self.num / self.den if self.den else 0.0

    def add(self, num: float, den: float) -> None:
        self.steps += 1
        self.num = self.num * self.decay + num
        self.den = self.den * self.decay + den


class RealizedSpeed(DiscountedRatio):
    """What one kind of step took per committed token, as actually measured: discounted
    time over discounted tokens, each step's time in width-1 passes of its moment (its
    seconds over the cost table's width-1 price then).

    Why in passes and not seconds: the guard compares a drafter's record with plain
    steps', and the two are taken at different moments. On a shared machine a pass swings
    40-70 ms within a reply: a head that drafted through a slow stretch (66 ms a token,
    width 1 then priced 65-70 ms) was benched for a whole reply against plain steps' 61 ms
    from the quiet stretch after it (width 1 at 54 ms). Plain steps time width 1 all the
    time, so its price follows the machine's load, and a record in its units does not.

    Why a ratio of sums and not an average of each step's seconds per token: a drafting
    step's tokens vary (1 to K+1) while its seconds barely do, so the average of ratios
    overstates the cost. A head at 40% acceptance whose 2-draft probes take 1.38 plain
    passes averages 1.07 passes per token that way, though they commit 1.56 tokens on
    average (0.88 passes per token): the guard benched a drafter that was winning.
    """

    def __init__(self) -> None:
        super().__init__(REALIZED_DECAY)
        self.last_step = 0  # the policy's step count at the newest step added

    @property
    def passes_per_token(self) -> float:
        return self.ratio


class StepOverhead(DiscountedRatio):
    """What one drafter's steps took (seconds) against what the cost model priced them at:
    the work per step the model cannot see, such as the Python around a verify pass (a
    drafter's catch-up after sitting out is left out: `DraftPolicy.update`).

    Why a factor and not just a margin: a step's seconds hardly depend on luck, so a few
    steps measure it, where tokens per second need many (how many drafts were accepted
    varies step to step)."""

    def __init__(self) -> None:
        super().__init__(OVERHEAD_DECAY)

    @property
    def factor(self) -> float:
        return self.ratio if self.den > 0 else 1.0


@dataclass(frozen=True)
class Choice:
    """What to do in the next step: drafter (None = plain step), draft length, the
    acceptance estimate it was chosen by, whether it probes an untested width, and whether
    it rechecks a drafter sitting out (an idle probe)."""

    drafter: str | None
    k: int
    estimate: str | None = None
    probe: bool = False
    recheck: bool = False


@dataclass
class PolicyMemory:
    """What a policy has learned about its drafters; kept by the session across replies,
    since acceptance and real costs belong to the model pair, not to one reply."""

    estimates: dict[str, AcceptanceEstimate] = field(default_factory=lambda: {
        key: AcceptanceEstimate(prior) for key, prior in PRIOR_ACCEPTANCE.items()})
    realized: dict[str, RealizedSpeed] = field(default_factory=dict)
    benched: dict[str, int] = field(default_factory=dict)  # drafter -> step it was benched
    strikes: dict[str, int] = field(default_factory=dict)  # drafter -> benches in a row
    steps: int = 0
    # per drafter sitting out: plain steps since it last drafted or was rechecked (no
    # entry while it drafts), and what its last two rechecks cost beyond plain steps
    # committing the same tokens (seconds; the cheaper spaces the next, so one slow
    # moment does not: a 150 ms step where ~60 was usual priced a head's recheck at
    # 94 ms and held the next off ~300 steps, sat out though it paid). Kept apart:
    # shared, the first drafter in line (layer-skip, whose rechecks are costly and useless
    # on chat) took every recheck and its price spaced them, so a trained head sitting out
    # was looked at again only while layer-skip was benched, every 100-200 steps
    idle: dict[str, int] = field(default_factory=dict)
    recheck_extra: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # the last cost probe: its step, and what its pass cost beyond a plain one once timed
    cost_probe: tuple[int, float] | None = None
    # per drafter: how often a draft tree's runner-up won where its first child lost
    tree_stats: dict[str, TreeStats] = field(default_factory=dict)
    # per drafter: its steps' seconds against the model's price for them
    overheads: dict[str, StepOverhead] = field(default_factory=dict)


class DraftPolicy:
    """Per step: which drafter and how many tokens, from costs and acceptance so far.

    `mode` is a drafter name or "auto" (among `available`). `fixed_k` pins K. A drafter that
    keeps failing falls to K = 0, with a short probe every PROBE_EVERY steps so it can recover.
    `ngram_match(context, k)` returns the tokens prompt lookup would draft now and the
    length of the matched suffix; each length keeps its own acceptance estimate (1, 2, 3,
    and 4 or more tokens: a one-token match is a guess, right far less often).

    Prompt lookup's guesses are free to check: when a step does not verify them in a pass,
    the token it commits next says whether the first guess was right (`observe`). So its
    estimates learn on every matched step without the policy paying to explore. With trees
    on, the check is the tree's first layer: a token another earlier match guessed is one
    the tree would have kept, so it counts as right (without this, a one-token match, whose
    chain guess is right ~30% of the time, was never drafted, though its tree's first
    layer held the token up to 44% of the time).

    Where lookup matched COPY_MATCH tokens or more and would draft, its draft stands: no
    other drafter is weighed against it. Why: a copy either goes on or stops at once, and
    the geometric model prices that as a middling per-token rate, so a head at ~40% looked
    as good there. Traced on the bundled code edits, a trained head took 15-21 steps a run
    after two-token matches and committed 1.65-1.85 tokens on each, where lookup's drafts
    there committed 2.4; `auto` ran x3.17-3.79 against lookup alone's x3.59-3.90. The other
    drafters keep the steps lookup would not draft, and those after a one-token match (a
    guess, not a copy).
    """

    def __init__(self, mode: str, available: Sequence[str], costs: CostModel | None,
                 fixed_k: int | None = None,
                 ngram_match: Callable[[Sequence[int], int],
                                       tuple[Sequence[int], int]] | None = None,
                 memory: PolicyMemory | None = None) -> None:
        self.mode = mode
        self.available = tuple(available)
        # the drafters a step may use, prompt lookup first (where it copies, `COPY_MATCH`,
        # its draft is not weighed against the others): all `available` ones under "auto";
        # otherwise the one named, and prompt lookup where it is available beside it (a
        # reply with a reference text)
        names = self.available if mode == "auto" else (
            mode, *(n for n in self.available if n == "ngram" != mode))
        self.candidates = tuple(sorted(names, key=lambda n: n != "ngram"))
        self.costs = costs
        self.fixed_k = fixed_k
        self.ngram_match = ngram_match
        self.memory = memory if memory is not None else PolicyMemory()
        self.cost_probes = COST_PROBES  # read when the policy is made (one per reply)
        # the cost probe before the one in flight: restored if that one's pass goes untimed
        self._probe_before: tuple[int, float] | None = None
        self._guess: tuple[str, int] | None = None  # (estimate key, guessed next token)

    @property
    def estimates(self) -> dict[str, AcceptanceEstimate]:
        return self.memory.estimates

    @property
    def realized(self) -> dict[str, RealizedSpeed]:
        return self.memory.realized

    def _is_benched(self, name: str) -> bool:
        """A drafter (for prompt lookup: a matched length) whose real time per token loses
        to plain steps (both in width-1 passes of their moments: `RealizedSpeed`) sits
        out a while.

        The cost model cannot see everything (Python overhead, a drafter's own work per
        step); this guard judges by what the steps actually took.
        """
        if self.fixed_k is not None or name.startswith("ngram"):
            # prompt lookup costs nothing to ask and its worth swings with the text; its
            # per-match-length estimates follow that faster than a bench would
            return False
        since = self.memory.benched.get(name)
        if since is not None:
            strikes = self.memory.strikes.get(name, 1)
            if self.memory.steps - since < min(GUARD_RETRY << (strikes - 1), GUARD_RETRY_MAX):
                return True
            # another chance on the text at hand: a fresh record (kept, the losing one
            # benched it again at once, before it took a step)
            del self.memory.benched[name]
            self.realized.pop(name, None)
        mine, plain = self.realized.get(name), self.realized.get("none")
        if mine is None or plain is None or mine.steps < GUARD_MIN_STEPS or plain.steps < 2:
            return False
        if self.memory.steps - mine.last_step > GUARD_FRESH:
            return False
        if mine.passes_per_token > plain.passes_per_token * (1.0 + GUARD_SLACK):
            self.memory.benched[name] = self.memory.steps
            self.memory.strikes[name] = self.memory.strikes.get(name, 0) + 1
            return True
        if mine.steps >= GUARD_CLEAR_STEPS:
            self.memory.strikes.pop(name, None)
        return False

    def _overhead(self, name: str) -> tuple[float, float]:
        """(overhead, margin) for drafting with `name`: what its steps took over what the
        model priced them at (1.0 until timed OVERHEAD_MIN_STEPS times), and the margin the
        model must then clear.

        Until timed, DRAFT_MARGIN stands in for what the model cannot see. Once timed, the
        model prices that itself and PROVEN_MARGIN (noise) is enough. Why: a drafter that
        truly gains less than DRAFT_MARGIN (a trained head at ~40% acceptance where a
        2-row pass costs 1.2x a 1-row one) was otherwise never used. Plain steps need no
        factor: their timings are the table's width-1 price itself.
        """
        mine = self.memory.overheads.get(name)
        if mine is None or mine.steps < OVERHEAD_MIN_STEPS:
            return 1.0, DRAFT_MARGIN
        low, high = OVERHEAD_RANGE
        return min(max(mine.factor, low), high), PROVEN_MARGIN

    def _estimate_key(self, name: str, match_len: int) -> str:
        return f"ngram{min(max(match_len, 1), 4)}" if name == "ngram" else name

    def choose(self, context: Sequence[int], pending: bool = False) -> Choice:
        """The next step's drafter and K; `pending` as in `best_k`."""
        best = Choice(None, 0)
        best_rate = 0.0 if self.costs is None else 1.0 / self.costs.verify(1)
        self.memory.steps += 1
        self._guess = None
        wanted: list[tuple[str, str, int]] = []  # (drafter, estimate key, longest draft)
        for name in self.candidates:
            limit = self.fixed_k or K_MAX
            match_len = 0
            if name == "ngram" and self.ngram_match is not None:
                tokens, match_len = self.ngram_match(context, limit + int(pending))
                if not tokens:
                    continue
                # from pending logits the first token guesses the pending one; K counts
                # the tokens verified after it
                limit = len(tokens) - int(pending)
                self._guess = (self._estimate_key(name, match_len), tokens[0])
            key = self._estimate_key(name, match_len)
            if self._is_benched(key):
                continue
            wanted.append((name, key, limit))
            if self.fixed_k is not None or self.costs is None:
                k, rate = limit, float("inf") if self.fixed_k else 0.0
            else:
                estimate = self.estimates.setdefault(key, AcceptanceEstimate(0.5))
                overhead, margin = self._overhead(name)
                k, rate = best_k(estimate.alpha, self.costs.draft_s.get(name, 0.0),
                                 self.costs, limit, pending, pending and name == "ngram",
                                 margin, overhead)
            if k > 0 and rate > best_rate:
                best, best_rate = Choice(name, k, key), rate
                if name == "ngram" and match_len >= COPY_MATCH:
                    break
        probe = self._cost_probe(wanted, best.k, pending)
        if probe is not None:
            self.memory.idle.pop(probe.drafter, None)
            return probe
        idle = self.memory.idle
        if best.drafter is not None:
            # its step is as good as a recheck. Lookup's steps hold no one's off: on chat,
            # where lookup drafts every few steps, a head whose estimate had dipped sat
            # out 300 steps without one
            idle.pop(best.drafter, None)
            return best
        # the drafter most overdue for a recheck, each spaced by its own price
        due, most = None, 1.0
        for name in self.candidates:
            if name == "ngram":
                continue
            idle[name] = idle.get(name, 0) + 1
            overdue = idle[name] / self._recheck_spacing(name)
            if overdue >= most and self._worth_probing(name):
                due, most = name, overdue
        if due is not None:
            idle.pop(due)
            return Choice(due, 2, due, recheck=True)
        return best

    def _recheck_spacing(self, name: str) -> float:
        """Idle steps before the next recheck of `name` sitting out: PROBE_EVERY, or more
        where its recent rechecks cost so much that they would take over RECHECK_SHARE."""
        if self.costs is None:
            return PROBE_EVERY
        extra = min(self.memory.recheck_extra.get(name, (0.0,)))
        return max(PROBE_EVERY, extra / (RECHECK_SHARE * self.costs.verify(1)))

    def _cost_probe(self, wanted: Sequence[tuple[str, str, int]], k: int,
                    pending: bool = False) -> Choice | None:
        """A draft verified at a width the cost table has not tested, when that width is
        wider than the chosen step's and a probe is due; else None.

        Why: a stale table (timed before a faster BLAS, or on a busy machine) can price
        wide passes so high that the policy never drafts, so they are never timed again.
        A probe is a normal draft-and-verify step (lossless); its pass times the width.
        Prompt lookup drafts what it matched (free to draft); other drafters double the
        widest tested width, up to PROBE_DRAFT_PASSES target passes' worth of drafting and
        no deeper than their acceptance reaches (`useful_depth`). Probes are spaced so they take about PROBE_SHARE of decode time, priced at what the
        last one cost beyond plain steps committing its tokens; the first may come at once.
        """
        costs = self.costs
        if not self.cost_probes or costs is None or self.fixed_k is not None:
            return None
        last = self.memory.cost_probe
        if last is not None:
            step, extra = last
            spacing = max(PROBE_EVERY, extra / (PROBE_SHARE * costs.verify(1)))
            if self.memory.steps - step < spacing:
                return None
        widest = max((w for w in range(1, K_MAX + 2) if costs.tested(w)), default=1)
        # verify passes as cheap as can be (`best_k`'s `flat`): a drafter that could not pay
        # even with them, at its acceptance so far, needs no probe, since knowing a wide
        # pass is cheap would not make it draft (a head at ~10% at T = 0.8 lost 4% to such
        # probes; without a head there, lookup's one-token guesses set off ~40 probes in
        # ten chat replies). Idle probes, not these, find out when a drafter's acceptance
        # comes back; lookup's estimates learn on every step for free
        for name, key, limit in wanted:
            probe_k = limit
            draft_s = costs.draft_s.get(name, 0.0)
            alpha = self.estimates.get(key, AcceptanceEstimate(0.5)).alpha
            if name == "ngram":
                # judged as `choose` judges lookup: from pending logits its first token
                # is a guess, and its own measured overhead and margin apply
                overhead, margin = self._overhead(name)
                if best_k(alpha, draft_s, costs, probe_k, pending, pending, margin,
                          overhead, flat=True)[0] == 0:
                    continue
            else:
                cheap = (PROBE_DRAFT_PASSES * costs.verify(1) / draft_s if draft_s > 0
                         else K_MAX)
                probe_k = min(limit, max(2, 2 * widest), max(1, int(cheap)),
                              useful_depth(alpha))
                if best_k(alpha, draft_s, costs, probe_k, True, flat=True)[0] == 0:
                    continue
            if probe_k > k and not costs.confirmed(probe_k + 1):
                # `update` prices the probe's pass once it has run
                self._probe_before = last
                self.memory.cost_probe = (self.memory.steps, 0.0)
                return Choice(name, probe_k, key, probe=True)
        return None

    def _worth_probing(self, name: str) -> bool:
        """Whether a drafter now at K = 0 could pay if its acceptance recovered."""
        if name == "ngram" or self._is_benched(name) or self.costs is None:
            return False
        draft_s = self.costs.draft_s.get(name, 0.0)
        # a probe follows idle plain steps, so it starts from pending logits
        return best_k(OPTIMISTIC_ACCEPTANCE, draft_s, self.costs, 4, pending=True)[0] > 0

    def observe(self, token: int, branched: bool = False) -> bool | None:
        """The token committed right after `choose` where prompt lookup's guess went unused:
        one free observation of its acceptance. `branched`: a tree's other first-layer
        node guessed it (with trees on, the draft would have kept it). Returns whether the
        chain's guess was right (None when there was none)."""
        if self._guess is None:
            return None
        key, guess = self._guess
        self._guess = None
        if self.costs is not None and self.fixed_k is None:
            self.estimates.setdefault(key, AcceptanceEstimate(0.5)).update(
                1, int(token == guess or branched))
        return token == guess

    def update(self, choice: Choice, n_drafted: int, n_accepted: int,
               seconds: float | None = None, width: int | None = None,
               step_seconds: float | None = None, n_tokens: int = 0,
               catchup_s: float = 0.0) -> None:
        """Record a step's outcome: acceptance, the measured cost of its target pass (when it
        says something about that width) and the whole step's seconds per committed token.

        `catchup_s`: what the drafter took, before the step, to catch up on positions other
        steps committed (not in `step_seconds`). It is what sitting out cost, so only a
        recheck's price counts it. In the step's own figures it kept a head out for good:
        after ~100 plain steps a head runs over every one of them first (~20 ms here,
        nearly half a pass), so each recheck timed 1.3-1.5x its price, the overhead factor
        stayed there, and the head sat out the rest of the run (on the bundled chat
        prompts, 2-3% of steps drafted in such runs, x1.03-1.08)."""
        if step_seconds is not None and n_tokens:
            if not choice.probe:
                # a cost probe drafts as long as the width it times, not as the policy
                # would: its seconds per token say nothing of the drafter's steps
                arm = choice.estimate or choice.drafter or "none"
                speed = self.realized.setdefault(arm, RealizedSpeed())
                # in width-1 passes of the moment, before this step's timing moves it
                unit = self.costs.verify(1) if self.costs is not None else 1.0
                speed.add(step_seconds / unit, n_tokens)
                speed.last_step = self.memory.steps
            if self.costs is not None and width and choice.drafter is not None:
                # priced at the width it ran at, before this timing corrects the table
                pass_price = self.costs.verify(width, width)
                priced = pass_price + choice.k * self.costs.draft_s.get(choice.drafter, 0.0)
                # the pass itself is the table's to learn (below): the step is counted with
                # its pass at the table's price. Counted whole, every slow or under-priced
                # pass was charged twice, by the table and by the factor: a head's first
                # ten steps, while live passes corrected the calibrated widths, set its
                # factor to 1.1-1.5 where it settles at ~1.0, and in one run of nine it
                # sat out ~150 steps
                table_learns = seconds is not None and self.fixed_k is None
                took = step_seconds - seconds + pass_price if table_learns else step_seconds
                overhead = self.memory.overheads.setdefault(choice.drafter, StepOverhead())
                # a slow moment counts at most SLOW_CLIP over the factor so far, as a slow
                # pass does in the cost table: two 2x steps raised a head's factor ~20%,
                # enough to stop it, and a factor only its own steps move stays there
                overhead.add(slow_capped(took, priced * max(overhead.factor, 1.0)), priced)
        if choice.estimate is not None:
            self.estimates.setdefault(choice.estimate, AcceptanceEstimate(0.5)).update(
                n_drafted, n_accepted)
        if choice.recheck and step_seconds is not None and self.costs is not None:
            extra = max(step_seconds + catchup_s - max(n_tokens, 1) * self.costs.verify(1),
                        0.0)
            last = self.memory.recheck_extra.get(choice.drafter, ())[-1:]
            self.memory.recheck_extra[choice.drafter] = (*last, extra)
        if choice.probe and seconds is None:
            # its pass went untimed (it built kernels for a new shape): it tested nothing,
            # so it must not hold the next probe off for PROBE_EVERY steps of a table
            # still stale (a whole reply's first quarter, all plain steps)
            self.memory.cost_probe = self._probe_before
        if seconds is not None and width and self.costs is not None and self.fixed_k is None:
            if choice.probe and self.memory.cost_probe is not None:
                # what it cost beyond plain steps committing the same tokens: a probe whose
                # drafts were accepted cost nothing
                extra = max(seconds - (n_accepted + 1) * self.costs.verify(1), 0.0)
                self.memory.cost_probe = (self.memory.cost_probe[0], extra)
            self.costs.observe(width, seconds)
