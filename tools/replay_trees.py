"""Replay prompt lookup's speculative loop against known replies: trees vs chains in seconds.

Why: `understudy bench` times real passes on a shared 2-core machine, where one run's
trees/chains ratio moves by a few percent, so a policy change worth 2% needs many 10-minute
runs. This replays the real loop (`speculative_steps` with the real `DraftPolicy`, tree
policy and `NgramDrafter`) against each prompt's plain reply, recorded once with the real
model at T = 0: a stand-in target answers every row of a pass from that reply (a row whose
path left the reply gets a token the reply never has there), and a virtual clock charges
each pass the timed cost of its width, plus `overlap` for a pass the host built while the
machine waited (every draft pass; a pipelined plain step hides its build). The policy sees
only that clock. Deterministic: the same inputs give the same figures.

What it does not see: other host time, context length's effect on a pass, noise, and
what a tree's pass costs over a chain's of its width unless told (`--tree-cost`: on the
demo here, step logs put it at 1.06-1.09). It predicted +1-6% for trees from one policy
idea that gained nothing in real runs, so a change it favours still needs
`understudy bench`.

    python -m tools.replay_trees record OUT.json PROMPTS.jsonl [PROMPTS.jsonl ...]
    python -m tools.replay_trees replay OUT.json [--costs CALIBRATION.json] [--curve CURVE.json]
                                    [--overlap S] [--tree-cost F]

`record` loads the demo model (or --model) and decodes each prompt plainly; `replay`
prints, per prompt file, tokens per virtual second and tau for trees and chains.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from engine.cache import make_caches
from engine.calibration import entry_to_costs
from engine.drafters.ngram import NgramDrafter
from engine.sampling import SamplingParams
from engine.speculative import speculative_steps
from engine.tuning import CostModel, DraftPolicy, PolicyMemory

NOT_IN_REPLY = 0  # what a row off the reply's path predicts: no path through it goes on
MISS_LOGIT = -30.0  # every other token's logit in a stand-in row (one-hot at T = 0)


@dataclass
class Recorded:
    """One prompt's token ids and its plain reply's, and the prompt file it came from."""

    source: str
    id: str
    prompt: list[int]
    reply: list[int]


class Clock:
    """Virtual seconds, advanced by the stand-in target's passes."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ReplyTarget:
    """A target that knows the text: row r of a pass predicts the reply's next token when
    the row's path (its ancestors in the pass, after the cached rows) follows the reply,
    and charges the clock for the pass. Keeps the cache offsets as a model would."""

    n_layers = 1

    def __init__(self, text: Sequence[int], vocab_size: int, curve: CostModel,
                 clock: Clock, overlap: float, tree_cost: float = 1.0) -> None:
        self.text = list(text)
        self.args = SimpleNamespace(vocab_size=vocab_size)
        self.curve, self.clock, self.overlap = curve, clock, overlap
        self.tree_cost = tree_cost

    def __call__(self, feed: mx.array, cache=None, mask=None, positions=None, n_layers=None):
        ids = np.array(feed)[0].tolist()
        width = len(ids)
        start = cache[0].offset
        rows = mx.zeros((1, 1, width, 1))
        cache[0].update_and_fetch(rows, rows)
        # each width at its own price (a row budget of `width`: the pass ran unpadded)
        # (a tree's pass, the one with a mask, at `tree_cost` times a chain's)
        self.clock.now += (self.curve.verify(width, width) * (1.0 if mask is None else self.tree_cost)
                           + (self.overlap if width > 1 else 0.0))
        seen = None if mask is None else np.array(mask)[:, -width:]
        out = np.full(width, NOT_IN_REPLY, dtype=np.int64)
        for r in range(width):
            path = list(range(r + 1)) if seen is None else [j for j in range(width) if seen[r, j]]
            n = start + len(path)
            if n < len(self.text) and all(ids[j] == self.text[start + i]
                                          for i, j in enumerate(path)):
                out[r] = self.text[n]
        logits = np.full((1, width, self.args.vocab_size), MISS_LOGIT, dtype=np.float32)
        logits[0, np.arange(width), out] = 0.0
        return mx.array(logits)


def replay_one(item: Recorded, tree: str, memory: PolicyMemory, costs: CostModel,
               curve: CostModel, vocab_size: int, overlap: float,
               tree_cost: float = 1.0) -> tuple[float, int, int]:
    """(virtual seconds, passes, tokens) of one reply decoded with prompt lookup."""
    clock = Clock()
    target = ReplyTarget(item.prompt + item.reply, vocab_size, curve, clock, overlap, tree_cost)
    caches = make_caches(1)
    prefix = mx.zeros((1, 1, len(item.prompt), 1))
    caches[0].update_and_fetch(prefix, prefix)
    first = np.full((vocab_size,), MISS_LOGIT, dtype=np.float32)
    first[item.reply[0]] = 0.0
    drafter = NgramDrafter()
    policy = DraftPolicy("ngram", ("ngram",), costs, None, drafter.match_with_length, memory)
    context = list(item.prompt)
    passes = 0
    for _ in speculative_steps(target, caches, context, mx.array(first),
                               SamplingParams(temperature=0.0), "coupled", {"ngram": drafter},
                               policy, tree=tree, clock=clock):
        passes += 1
        if len(context) - len(item.prompt) >= len(item.reply):
            break
    return clock.now, passes, len(item.reply)


def replay(items: Sequence[Recorded], costs_entry: dict, vocab_size: int, overlap: float,
           curve: dict[int, float] | None = None,
           tree_cost: float = 1.0) -> dict[str, dict[str, float]]:
    """Per prompt file: tokens per virtual second and tau for trees ("auto") and chains
    ("off"), each mode with one policy memory across its prompts, as a bench session keeps,
    after one warm-up reply. Passes are charged by `curve` (seconds by width; default: the
    policy's own starting table, `costs_entry`), a tree's pass at `tree_cost` times its
    width's price."""
    report: dict[str, dict[str, float]] = {}
    for source in dict.fromkeys(i.source for i in items):
        group = [i for i in items if i.source == source]
        row: dict[str, float] = {}
        for tree in ("auto", "off"):
            memory, costs = PolicyMemory(), entry_to_costs(costs_entry)
            # a copy: the policy's table learns from the passes, the charged curve stays
            charged = CostModel(dict(curve or costs.verify_s))
            replay_one(group[0], tree, memory, costs, charged, vocab_size, overlap, tree_cost)
            seconds = passes = tokens = 0
            for item in group:
                s, p, n = replay_one(item, tree, memory, costs, charged, vocab_size, overlap,
                                     tree_cost)
                seconds, passes, tokens = seconds + s, passes + p, tokens + n
            row[f"{tree}_tps"] = tokens / seconds
            row[f"{tree}_tau"] = tokens / passes
        row["trees_vs_chains"] = row["auto_tps"] / row["off_tps"]
        report[source] = row
    return report


def record(prompt_files: Sequence[Path], model: str, max_tokens: int) -> list[Recorded]:
    """Each prompt's plain reply (T = 0) from the real model, as token ids."""
    from engine.bench import load_prompts
    from engine.decode import ChatSession, GenerateOptions
    from engine.events import Finished
    from engine.loading import load_model

    session = ChatSession(load_model(model))
    options = GenerateOptions(max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))
    out = []
    for path in prompt_files:
        for p in load_prompts(path):
            session.reset()
            done = [e for e in session.generate(p.messages, options) if isinstance(e, Finished)]
            out.append(Recorded(path.stem, p.id, list(session.encode(p.messages)),
                                list(done[-1].token_ids)))
            print(f"{path.stem} {p.id}: {len(out[-1].reply)} tokens", file=sys.stderr)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.replay_trees",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="decode prompts plainly with the real model")
    rec.add_argument("out", type=Path)
    rec.add_argument("prompts", type=Path, nargs="+")
    rec.add_argument("--model", default="demo")
    rec.add_argument("--max-tokens", type=int, default=128)
    rep = sub.add_parser("replay", help="trees vs chains against recorded replies")
    rep.add_argument("recorded", type=Path)
    rep.add_argument("--costs", type=Path, help="a calibration.json: its first entry is used "
                     "(default: the app-data dir's)")
    rep.add_argument("--curve", type=Path, help="JSON {width: seconds} the passes are charged "
                     "by, e.g. timed at a reply's context length (default: --costs's table)")
    rep.add_argument("--overlap", type=float, help="seconds a host-built pass waits "
                     "(default: the entry's overlap_s)")
    rep.add_argument("--tree-cost", type=float, default=1.0, help="what a tree's pass costs "
                     "over a chain's of the same width (timed here: 1.06-1.09)")
    args = parser.parse_args(argv)
    if args.command == "record":
        rows = record(args.prompts, args.model, args.max_tokens)
        args.out.write_text(json.dumps([r.__dict__ for r in rows]))
        return 0
    from engine.calibration import CALIBRATION_FILE
    from engine.paths import cache_dir

    table = json.loads((args.costs or cache_dir() / CALIBRATION_FILE).read_text())
    entry = next(iter(table.values()))
    items = [Recorded(**r) for r in json.loads(args.recorded.read_text())]
    vocab = max(max(i.prompt + i.reply) for i in items) + 1
    overlap = args.overlap if args.overlap is not None else float(entry.get("overlap_s", 0.0))
    curve = ({int(w): float(v) for w, v in json.loads(args.curve.read_text()).items()}
             if args.curve else None)
    report = replay(items, entry, vocab, overlap, curve, args.tree_cost)
    for source, row in report.items():
        print(f"{source:24s} trees {row['auto_tps']:7.1f} tok/s tau {row['auto_tau']:5.2f} | "
              f"chains {row['off_tps']:7.1f} tok/s tau {row['off_tau']:5.2f} | "
              f"trees/chains x{row['trees_vs_chains']:.3f}")
    ratios = [row["trees_vs_chains"] for row in report.values()]
    print(f"geomean trees/chains x{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
