"""Choosing the draft length K (and, in auto mode, the drafter) for each step.

A step with K drafts costs K draft tokens plus one target pass of width K+1, and commits
on average (1 - a^(K+1)) / (1 - a) tokens when each draft is accepted with probability a.
We measure the costs once per model/drafter/backend (cached in the app-data dir), keep a
running acceptance estimate per drafter, and pick the K with the most tokens per second —
K = 0 (a plain step) when drafting does not pay.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import mlx.core as mx

from engine.cache import make_caches
from engine.paths import cache_dir

CALIBRATION_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
K_MAX = 15
PRIOR_ACCEPTANCE = {"model": 0.6, "layerskip": 0.3,
                    # prompt lookup, by matched suffix length: longer matches copy better
                    "ngram2": 0.1, "ngram3": 0.25, "ngram4": 0.55}
OPTIMISTIC_ACCEPTANCE = 0.8  # a drafter that cannot pay even at this rate is never probed
DRAFT_MARGIN = 0.15
COST_EMA = 0.2  # weight of a new timing in the running per-width cost
PROBE_EVERY = 16  # steps without drafting before one probe with a short draft
GUARD_MIN_STEPS = 2  # steps of a drafter before its realized speed can bench it
GUARD_RETRY = 1024  # steps after which a benched drafter gets one more chance (a losing
# probe of a drafter that costs half a target pass per token wastes a few steps)


@dataclass
class CostModel:
    """Measured seconds: target pass by width, and one draft token per drafter."""

    verify_s: dict[int, float]
    draft_s: dict[str, float] = field(default_factory=dict)
    # what a step loses when it must read the pending token before building its pass: a
    # pipelined plain step builds the next pass while the last one finishes (about the
    # graph-building time of a width-1 pass)
    overlap_s: float = 0.0

    def __post_init__(self) -> None:
        # verify() for every width up to K_MAX + 1, rebuilt after a change: the policy asks
        # for the whole curve every step, and the step's host time competes with the pass
        self._curve: list[float] | None = None

    def observe(self, width: int, seconds: float) -> None:
        """Fold a measured pass into the table, so costs follow the machine's load."""
        old = self.verify_s.get(width)
        self.verify_s[width] = seconds if old is None else old + COST_EMA * (seconds - old)
        self._curve = None

    def verify(self, width: int) -> float:
        """Seconds for one target pass over `width` tokens (linear between measurements).

        Never less for a wider pass: noisy timings must not make drafting look free.
        """
        if self._curve is None:
            points = self._points()
            self._curve = [_interpolate(points, w) for w in range(K_MAX + 2)]
        if 0 <= width < len(self._curve):
            return self._curve[width]
        return _interpolate(self._points(), width)

    def _points(self) -> list[tuple[int, float]]:
        """The measured (width, seconds), made non-decreasing in width."""
        points: list[tuple[int, float]] = []
        for w, sec in sorted(self.verify_s.items()):
            points.append((w, max(sec, points[-1][1]) if points else sec))
        return points


def _interpolate(points: list[tuple[int, float]], width: int) -> float:
    """Piecewise-linear through `points`, extended past the last two."""
    if width <= points[0][0]:
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
           pending: bool = False, guessed: bool = False) -> tuple[int, float]:
    """The K in [0, k_max] with the highest expected tokens/s, and that rate.

    `pending`: the target's logits for the next position are in flight, so drafting first
    reads that token and loses the overlap a pipelined plain step has (`overlap_s`).
    `guessed`: the draft begins with a guess of that pending token (prompt lookup), so its
    K further tokens are verified only when the guess was right (probability alpha); a
    wrong guess leaves a plain step. Drafting must also beat plain by DRAFT_MARGIN, which
    covers the per-step work the pipelined plain path hides.
    """
    widths = [costs.verify(w) for w in range(k_max + 2)]  # widths[w]: one pass of width w
    plain = 1.0 / widths[1]
    extra = costs.overlap_s if pending or guessed else 0.0
    best = (0, plain)
    for k in range(1, k_max + 1):
        tokens, seconds = expected_tokens(alpha, k), k * draft_s + widths[k + 1]
        if guessed:
            tokens = alpha * tokens + (1.0 - alpha)
            seconds = alpha * seconds + (1.0 - alpha) * widths[1]
        rate = tokens / (seconds + extra)
        if rate > best[1]:
            best = (k, rate)
    if best[0] and best[1] < plain * (1.0 + DRAFT_MARGIN):
        return 0, plain
    return best


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
class RealizedSpeed:
    """Running seconds per committed token of one kind of step, as actually measured."""

    seconds_per_token: float = 0.0
    steps: int = 0

    def add(self, seconds: float, n_tokens: int) -> None:
        value = seconds / n_tokens
        self.steps += 1
        if self.steps == 1:
            self.seconds_per_token = value
        else:
            self.seconds_per_token += COST_EMA * (value - self.seconds_per_token)


def _median(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up (graph building, allocation)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return _median(samples)


def measure_costs(model, draft_model=None, layerskip_layers: int | None = None,
                  context: int = 64, reps: int = 5) -> CostModel:
    """Time target passes of each width after `context` tokens, and draft tokens."""
    caches = make_caches(model.n_layers)
    prefix = mx.zeros((1, context), dtype=mx.int32)
    mx.eval(model(prefix, cache=caches))

    def target_pass(width: int, n_layers: int | None = None) -> Callable[[], object]:
        def run() -> object:
            out = model(mx.zeros((1, width), dtype=mx.int32), cache=caches, n_layers=n_layers)
            mx.eval(out)
            for c in caches:
                c.trim(context)
            return out
        return run

    verify_s = {w: _time(target_pass(w), reps) for w in CALIBRATION_WIDTHS}

    builds = []  # the host's share of a width-1 pass: building its graph
    for _ in range(reps):
        t0 = time.perf_counter()
        out = model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
        builds.append(time.perf_counter() - t0)
        mx.eval(out)
        for c in caches:
            c.trim(context)
    overlap_s = _median(builds)
    draft_s: dict[str, float] = {"ngram": 0.0}
    if layerskip_layers:
        draft_s["layerskip"] = _time(target_pass(1, layerskip_layers), reps)
    if draft_model is not None:
        d_caches = make_caches(draft_model.n_layers)
        mx.eval(draft_model(prefix, cache=d_caches))

        def draft_pass() -> object:
            out = draft_model(mx.zeros((1, 1), dtype=mx.int32), cache=d_caches)
            mx.eval(out)
            for c in d_caches:
                c.trim(context)
            return out

        draft_s["model"] = _time(draft_pass, reps)
    return CostModel(verify_s, draft_s, overlap_s)


def load_or_measure_costs(key: str, measure: Callable[[], CostModel]) -> CostModel:
    """Calibration results cached in the app-data dir under `key` (model/drafter/backend)."""
    path = cache_dir() / "calibration.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    entry = table.get(key)
    if isinstance(entry, dict):
        try:
            return CostModel({int(w): float(s) for w, s in entry["verify_s"].items()},
                             {str(d): float(s) for d, s in entry["draft_s"].items()},
                             float(entry.get("overlap_s", 0.0)))
        except (KeyError, TypeError, ValueError):
            pass
    costs = measure()
    table[key] = asdict(costs)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1))
    tmp.replace(path)
    return costs


@dataclass(frozen=True)
class Choice:
    """What to do in the next step: drafter (None = plain step), draft length, and the
    acceptance estimate it was chosen by."""

    drafter: str | None
    k: int
    estimate: str | None = None


@dataclass
class PolicyMemory:
    """What a policy has learned about its drafters; kept by the session across replies,
    since acceptance and real costs belong to the model pair, not to one reply."""

    estimates: dict[str, AcceptanceEstimate] = field(default_factory=lambda: {
        key: AcceptanceEstimate(prior) for key, prior in PRIOR_ACCEPTANCE.items()})
    realized: dict[str, RealizedSpeed] = field(default_factory=dict)
    benched: dict[str, int] = field(default_factory=dict)  # drafter -> step it was benched
    steps: int = 0
    idle: int = 0


class DraftPolicy:
    """Per step: which drafter and how many tokens, from costs and acceptance so far.

    `mode` is a drafter name or "auto" (among `available`). `fixed_k` pins K. A drafter that
    keeps failing falls to K = 0, with a short probe every PROBE_EVERY steps so it can recover.
    `ngram_match(context, k)` returns the tokens prompt lookup would draft now and the
    length of the matched suffix; each length keeps its own acceptance estimate.

    Prompt lookup's guesses are free to check: when a step does not verify them in a pass,
    the token it commits next says whether the first guess was right (`observe`). So its
    estimates learn on every matched step without the policy paying to explore.
    """

    def __init__(self, mode: str, available: Sequence[str], costs: CostModel | None,
                 fixed_k: int | None = None,
                 ngram_match: Callable[[Sequence[int], int],
                                       tuple[Sequence[int], int]] | None = None,
                 memory: PolicyMemory | None = None) -> None:
        self.mode = mode
        self.available = tuple(available)
        self.costs = costs
        self.fixed_k = fixed_k
        self.ngram_match = ngram_match
        self.memory = memory if memory is not None else PolicyMemory()
        self._guess: tuple[str, int] | None = None  # (estimate key, guessed next token)

    @property
    def estimates(self) -> dict[str, AcceptanceEstimate]:
        return self.memory.estimates

    @property
    def realized(self) -> dict[str, RealizedSpeed]:
        return self.memory.realized

    def _is_benched(self, name: str) -> bool:
        """A drafter (for prompt lookup: a matched length) whose real seconds per token lose
        to plain steps sits out a while.

        The cost model cannot see everything (Python overhead, cache catch-up, a busy
        machine); this guard judges by what the steps actually took.
        """
        if self.fixed_k is not None or name.startswith("ngram"):
            # prompt lookup costs nothing to ask and its worth swings with the text; its
            # per-match-length estimates follow that faster than a bench would
            return False
        since = self.memory.benched.get(name)
        if since is not None:
            if self.memory.steps - since < GUARD_RETRY:
                return True
            # one more chance: its record stays, so one more losing step benches it again
            del self.memory.benched[name]
        mine, plain = self.realized.get(name), self.realized.get("none")
        if mine is None or plain is None or mine.steps < GUARD_MIN_STEPS or plain.steps < 2:
            return False
        if mine.seconds_per_token > plain.seconds_per_token:
            self.memory.benched[name] = self.memory.steps
            return True
        return False

    def _candidates(self) -> tuple[str, ...]:
        return self.available if self.mode == "auto" else (self.mode,)

    def _estimate_key(self, name: str, match_len: int) -> str:
        return f"ngram{min(max(match_len, 2), 4)}" if name == "ngram" else name

    def choose(self, context: Sequence[int], pending: bool = False) -> Choice:
        """The next step's drafter and K; `pending` as in `best_k`."""
        best = Choice(None, 0)
        best_rate = 0.0 if self.costs is None else 1.0 / self.costs.verify(1)
        self.memory.steps += 1
        self._guess = None
        for name in self._candidates():
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
            if self.fixed_k is not None or self.costs is None:
                k, rate = limit, float("inf") if self.fixed_k else 0.0
            else:
                estimate = self.estimates.setdefault(key, AcceptanceEstimate(0.5))
                k, rate = best_k(estimate.alpha, self.costs.draft_s.get(name, 0.0),
                                 self.costs, limit, pending, pending and name == "ngram")
            if k > 0 and rate > best_rate:
                best, best_rate = Choice(name, k, key), rate
        if best.drafter is not None:
            self.memory.idle = 0
            return best
        self.memory.idle += 1
        if self.memory.idle % PROBE_EVERY == 0:
            probe = next((d for d in self._candidates() if self._worth_probing(d)),
                         None)
            if probe is not None:
                self.memory.idle = 0
                return Choice(probe, 2, probe)
        return best

    def _worth_probing(self, name: str) -> bool:
        """Whether a drafter now at K = 0 could pay if its acceptance recovered."""
        if name == "ngram" or self._is_benched(name) or self.costs is None:
            return False
        draft_s = self.costs.draft_s.get(name, 0.0)
        # a probe follows idle plain steps, so it starts from pending logits
        return best_k(OPTIMISTIC_ACCEPTANCE, draft_s, self.costs, 4, pending=True)[0] > 0

    def observe(self, token: int) -> bool | None:
        """The token committed right after `choose` where prompt lookup's guess went unused:
        one free observation of its acceptance. Returns whether the guess was right (None
        when there was none)."""
        if self._guess is None:
            return None
        key, guess = self._guess
        self._guess = None
        if self.costs is not None and self.fixed_k is None:
            self.estimates.setdefault(key, AcceptanceEstimate(0.5)).update(1, int(token == guess))
        return token == guess

    def update(self, choice: Choice, n_drafted: int, n_accepted: int,
               seconds: float | None = None, width: int | None = None,
               step_seconds: float | None = None, n_tokens: int = 0) -> None:
        """Record a step's outcome: acceptance, the measured cost of its target pass (when it
        says something about that width) and the whole step's seconds per committed token."""
        if step_seconds is not None and n_tokens:
            arm = choice.estimate or choice.drafter or "none"
            self.realized.setdefault(arm, RealizedSpeed()).add(step_seconds, n_tokens)
        if choice.estimate is not None:
            self.estimates.setdefault(choice.estimate, AcceptanceEstimate(0.5)).update(
                n_drafted, n_accepted)
        if seconds is not None and width and self.costs is not None and self.fixed_k is None:
            self.costs.observe(width, seconds)
