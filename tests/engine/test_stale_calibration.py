"""A stale calibration must not turn speculation off for good (issue 10, item 1).

The demo model on code-editing prompts, replies side by side in one process (`engine.turns`,
as `understudy bench` runs them): plain decoding; prompt lookup with a fresh calibration
(SESSIONS sessions); prompt lookup with the same calibration seeded stale (as many) in
`calibration.json` (every width >= 2 priced 10x, as a table timed before OpenBLAS was
installed); and the stale one again with cost probes switched off, the negative control
that shows the lock-out the probes exist to break.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

import engine.tuning
from engine.bench import DEFAULT_PROMPTS, Run, Totals, load_prompts
from engine.calibration import CALIBRATION_FILE
from engine.decode import ChatSession, GenerateOptions
from engine.events import Finished
from engine.loading import load_model
from engine.tuning import CostModel
from engine.turns import take_turns

# one prompt: the recovery must happen within it (more for a note's figure:
# STALE_BENCH_PROMPTS=10 pytest -s this file)
N_PROMPTS = int(os.environ.get("STALE_BENCH_PROMPTS", "1"))
MAX_TOKENS = 128  # `understudy bench`'s default reply length
# Turns of 2 steps, not the bench's 8: a code-editing reply here is only ~20 speculative
# steps, so turns of 8 gave each session 2-3 turns, too few for the order swaps to even out
# the machine's drift, and two sessions' mean ratio stale/fresh scattered over 0.90-1.00
# (twice under 0.9 in CI) while both tables chose the same drafts step for step.
SLICE_STEPS = 2
# Sessions of each kind, the figure compared being their mean. One session's speedup
# on this ~20-pass reply moves by ~8% between identical sessions (one draft chosen
# differently on a noisy timing shifts where later drafts line up), so two sessions'
# ratio stale/fresh still fell under 0.9 about one run in five; with three, over 22 runs
# (with `CostModel`'s refinement after a correction): mean 0.99, 21 in 0.90-1.16, one at
# 0.77. That one, and a CI run failing both tries (0.84, 0.85), was a session whose first
# probe traced, so its pass went untimed and the next probe waited 16 plain steps; now
# retried at once (`DraftPolicy.update`). Since, over 23 runs: one at 0.89 (a slow first
# probe timing, two sessions drafting a step later), which the retry below is for.
SESSIONS = 3
STALE_FACTOR = 10.0
# The figure: within 10% of a fresh calibration's speedup, within the first
# prompt. A wide probe corrects every stale width at once (`CostModel.observe`), so from
# the first prompt's third or fourth step the two tables price passes alike.
TOLERANCE = 0.10


def seed_stale(fresh_dir: Path, stale_dir: Path) -> None:
    """Copy the fresh calibration with every width >= 2 priced STALE_FACTOR times higher.

    Each raw entry is inflated, so the stale table keeps the fresh one's shape (its dips
    are what `pad_width` pads to; inflating the padded curve instead flattened them, and a
    rescaled stale table then ran narrow passes unpadded, a few percent slower), but never
    from below width 1: on a busy machine a calibration's width-1 median can come out
    above wider ones, and a wide entry 10x that would still be under 10x width 1.
    """
    table = json.loads((fresh_dir / "cache" / CALIBRATION_FILE).read_text())
    for entry in table.values():
        raw = entry["verify_s"]
        entry["verify_s"] = {w: max(s, raw["1"]) * STALE_FACTOR if int(w) >= 2 else s
                             for w, s in raw.items()}
    (stale_dir / "cache").mkdir(parents=True)
    (stale_dir / "cache" / CALIBRATION_FILE).write_text(json.dumps(table))


def side_by_side(sessions: dict[str, ChatSession], messages: list[dict[str, str]],
                 options: dict[str, GenerateOptions], probes: dict[str, bool],
                 monkeypatch: pytest.MonkeyPatch) -> dict[str, Run]:
    """Every reply from a cold cache, taking turns; a policy reads COST_PROBES when made."""
    streams = {}
    for name, session in sessions.items():
        session.reset()
        monkeypatch.setattr(engine.tuning, "COST_PROBES", probes.get(name, True))
        streams[name] = session.generate(messages, options[name])
    monkeypatch.setattr(engine.tuning, "COST_PROBES", True)
    runs = {}
    for turn in take_turns(streams, lambda steps, _seconds: steps >= SLICE_STEPS):
        if isinstance(turn.event, Finished):
            f = turn.event
            runs[turn.name] = Run(f.text, replace(f.stats, decode_s=turn.own_s))
    return runs


@dataclass
class Measured:
    """One side-by-side run: each session's speedup (first prompt, all prompts), the
    figures compared (the mean of the SESSIONS sessions of a kind), and what the tables
    did."""

    each: dict[str, tuple[float, float]]
    figures: dict[str, tuple[float, float]]
    first_stale: Run
    corrected_in_first: list[tuple[int, float, float]]
    stale: CostModel
    control: CostModel
    control_drafted: int

    @property
    def recovered(self) -> bool:
        """Within TOLERANCE of the fresh calibration on the first prompt, and overall."""
        return all(self.figures["stale"][i] >= (1 - TOLERANCE) * self.figures["fresh"][i]
                   for i in (0, 1))


def measure(target, prompts: list, root: Path, monkeypatch: pytest.MonkeyPatch) -> Measured:
    # chains only: the item is the cost table, and draft trees price extra rows from it too
    spec = GenerateOptions(max_tokens=MAX_TOKENS, drafter="ngram", tree="off")
    # SESSIONS of each kind, fresh and stale taking alternate places in the turns
    kinds = {kind: [kind] + [f"{kind}{i}" for i in range(2, SESSIONS + 1)]
             for kind in ("fresh", "stale")}
    options = {"plain": GenerateOptions(max_tokens=MAX_TOKENS)}
    for fresh, stale in zip(kinds["fresh"], kinds["stale"], strict=True):
        options |= {fresh: spec, stale: spec}
    options["control"] = spec
    fresh_dir, stale_dir = root / "fresh", root / "stale"
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(fresh_dir))
    sessions = {name: ChatSession(target) for name in options}
    # the fresh sessions calibrate now (and warm the model up); the stale ones load the
    # same table, seeded stale, when their first reply starts
    for name in kinds["fresh"]:
        list(sessions[name].generate(prompts[0].messages, replace(spec, max_tokens=1)))
    seed_stale(fresh_dir, stale_dir)
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(stale_dir))

    totals = {name: Totals() for name in options if name != "plain"}
    first: dict[str, Run] = {}
    corrected_in_first: list[tuple[int, float, float]] = []
    for i, p in enumerate(prompts):
        names = list(options) if i % 2 == 0 else list(reversed(options))
        runs = side_by_side({n: sessions[n] for n in names}, p.messages, options,
                            {"control": False}, monkeypatch)
        if not first:
            first = runs
            stale_costs = sessions["stale"].costs
            assert stale_costs is not None
            corrected_in_first = list(stale_costs.corrections)
        for name, t in totals.items():
            t.add(runs["plain"], runs[name])
            assert runs[name].text == runs["plain"].text  # probes are normal, lossless steps

    def speedup(name: str, runs: dict[str, Run] | None = None) -> float:
        if runs is None:
            return totals[name].row()["speedup"]
        r, plain = runs[name].stats, runs["plain"].stats
        return (r.generated_tokens / r.decode_s) / (plain.generated_tokens / plain.decode_s)

    each = {n: (speedup(n, first), speedup(n)) for n in totals}
    figures = {kind: tuple(sum(each[n][i] for n in names) / len(names) for i in (0, 1))
               for kind, names in kinds.items()}
    figures["control"] = each["control"]
    print("speedup (first prompt, all prompts):",
          {n: f"x{a:.2f}, x{b:.2f}" for n, (a, b) in figures.items()},
          "sessions:", {n: f"x{a:.2f}, x{b:.2f}" for n, (a, b) in each.items()})
    stale, control = sessions["stale"].costs, sessions["control"].costs
    assert stale is not None and control is not None
    return Measured(each, figures, first["stale"], corrected_in_first, stale, control,
                    totals["control"].drafted)


@pytest.mark.slow
def test_a_stale_calibration_recovers_within_the_first_prompt(
        demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [p for p in load_prompts(DEFAULT_PROMPTS)
               if p.category == "code-editing"][:N_PROMPTS]
    target = load_model(str(demo_model_dir))
    m = measure(target, prompts, tmp_path / "run1", monkeypatch)
    if not m.recovered:
        # Noise policy, fixed in advance: one more run, which must pass. Two sessions'
        # mean still moves by ~7% between identical runs when other work shares the two
        # cores; a table that stayed stale fails both (the control sits at ~x1.0 vs ~x2).
        m = measure(target, prompts, tmp_path / "run2", monkeypatch)
    # the stale table was corrected by live passes within the first prompt ...
    notes = (f"{m.each}; stale table corrections {m.stale.corrections}; control "
             f"corrections {m.control.corrections}, drafted {m.control_drafted}")
    assert any(w >= 2 and new < old / 2 for w, old, new in m.corrected_in_first), notes
    assert m.first_stale.stats.n_drafted > 0, notes
    # ... so within that first prompt the speedup is within TOLERANCE of the fresh
    # calibration's, and over the whole bench too
    assert m.figures["fresh"][1] > 1.3, notes
    assert m.recovered, notes
    # negative control: without probes the stale table locks prompt lookup out for good
    assert m.control_drafted == 0 and not m.control.tested(2), notes
    assert m.figures["control"][1] < 0.9 * m.figures["fresh"][1], notes
