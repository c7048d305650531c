"""The offline replay of prompt lookup (tools/replay_trees.py): its stand-in target answers
from the reply and charges the virtual clock by width, the real loop commits exactly the
reply, and text that never repeats replays as plain decoding in both modes."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from engine.cache import make_caches
from engine.tree import DraftTree, ancestor_mask
from engine.tuning import CostModel, PolicyMemory
from tests.fixtures.tiny_models import write_tiny_model
from tools.replay_trees import (
    NOT_IN_REPLY,
    Clock,
    Recorded,
    ReplyTarget,
    main,
    replay,
    replay_one,
)

CURVE = {1: 0.050, 2: 0.060, 4: 0.070, 8: 0.080, 16: 0.090, 32: 0.120}
ENTRY = {"format": 2, "verify_s": {str(w): s for w, s in CURVE.items()},
         "draft_s": {"ngram": 0.0}, "overlap_s": 0.004}
# a reply that copies its prompt's function twice, with one edit (9 -> 10) the second time
BODY = [21, 22, 23, 24, 25, 26, 27, 28, 9, 29, 30, 31, 32, 33, 34, 35]
PROMPT = [1, 2, 3, *BODY, 4, 5]
REPLY = [*BODY[:8], 10, *BODY[9:], 6, *BODY[:8], 10, *BODY[9:], 7]


def target_for(text: list[int], cached: int) -> tuple[ReplyTarget, Clock, list]:
    clock = Clock()
    target = ReplyTarget(text, 64, CostModel(dict(CURVE)), clock, overlap=0.004)
    caches = make_caches(1)
    rows = mx.zeros((1, 1, cached, 1))
    caches[0].update_and_fetch(rows, rows)
    return target, clock, caches


def test_the_stand_in_answers_rows_on_the_reply_and_charges_the_pass_by_width() -> None:
    text = [5, 6, 7, 8, 9, 10]
    target, clock, caches = target_for(text, cached=2)  # rows for 5, 6 are cached
    # a chain fed after the cache: 7 (the newest token), then drafts 8 (right), 3 (wrong)
    logits = target(mx.array([[7, 8, 3]]), cache=caches)
    assert mx.argmax(logits[0], axis=-1).tolist() == [8, 9, NOT_IN_REPLY]
    assert clock.now == pytest.approx(CURVE[2] + (CURVE[4] - CURVE[2]) / 2 + 0.004)
    assert caches[0].offset == 5
    # a tree: root 7 with children 8 (right) and 4 (wrong); 9 under 8
    target, clock, caches = target_for(text, cached=2)
    tree = DraftTree((8, 9, 4), (-1, 0, -1))
    feed = mx.array([[7, *tree.ids]])
    logits = target(feed, cache=caches, mask=ancestor_mask(tree, 2))
    assert mx.argmax(logits[0], axis=-1).tolist() == [8, 9, 10, NOT_IN_REPLY]
    chain_price = CURVE[4] + 0.004  # 4 rows
    assert clock.now == pytest.approx(chain_price)  # a tree at its width's price ...
    dear, clock, caches = target_for(text, cached=2)
    dear.tree_cost = 1.5
    dear(feed, cache=caches, mask=ancestor_mask(tree, 2))
    assert clock.now == pytest.approx(1.5 * (chain_price - 0.004) + 0.004)  # ... or above it
    # a width-1 pass is a pipelined plain step: no host build to wait for
    target, clock, caches = target_for(text, cached=2)
    target(mx.array([[7]]), cache=caches)
    assert clock.now == pytest.approx(CURVE[1])


@pytest.mark.parametrize("tree", ["auto", "off"])
def test_the_real_loop_replays_to_exactly_the_reply(tree: str) -> None:
    item = Recorded("edits", "copy", PROMPT, REPLY)
    seconds, passes, tokens = replay_one(item, tree, PolicyMemory(), CostModel(dict(CURVE)),
                                         CostModel(dict(CURVE)), 64, 0.004)
    assert tokens == len(REPLY)
    assert passes < len(REPLY) / 2  # the copies were drafted, several tokens a pass
    assert len(REPLY) * CURVE[1] / 4 < seconds < len(REPLY) * CURVE[1]


def test_text_that_never_repeats_replays_as_plain_decoding_in_both_modes() -> None:
    """The negative control: nothing to look up, so every pass commits one token and trees
    and chains take the same time."""
    fresh = Recorded("fresh", "none", list(range(1, 20)), list(range(20, 60)))
    report = replay([fresh, fresh], ENTRY, 64, 0.004)["fresh"]
    assert report["auto_tau"] == report["off_tau"] == 1.0
    assert report["trees_vs_chains"] == 1.0
    copying = replay([Recorded("edits", "copy", PROMPT, REPLY)] * 2, ENTRY, 64, 0.004)
    assert copying["edits"]["off_tau"] > 2.0


def test_record_then_replay_from_the_command_line(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    model = write_tiny_model(tmp_path / "tiny")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": "code-editing",
                                           "messages": [{"role": "user", "content": c}]}) + "\n"
                               for i, c in enumerate(["abc abc abc", "hello hello"])))
    out = tmp_path / "rec.json"
    assert main(["record", str(out), str(prompts), "--model", str(model),
                 "--max-tokens", "12"]) == 0
    rows = json.loads(out.read_text())
    assert [r["id"] for r in rows] == ["p0", "p1"] and all(r["reply"] for r in rows)
    costs = tmp_path / "calibration.json"
    costs.write_text(json.dumps({"key": ENTRY}))
    assert main(["replay", str(out), "--costs", str(costs)]) == 0
    printed = capsys.readouterr().out
    assert "p " in printed and "trees/chains x" in printed and "geomean" in printed
