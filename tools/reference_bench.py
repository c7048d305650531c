"""What drafting from the reply being replaced gains (Regenerate, Edit, a `prediction`).

For each prompt of a bench set: a first reply, then the reply the user gets after Edit
(the last message with `--edit` appended) or Regenerate (`--edit ''` and another seed),
written three ways in one process: plain, `--drafter` alone, and `--drafter` with the
first reply as its reference (`GenerateOptions.reference`). Every text must equal plain
decoding's; the ratios are tokens/s over plain, per category and overall.

    python -m tools.reference_bench --per-category 3 --temperature 0 --edit " Thanks!"
    python -m tools.reference_bench --per-category 3 --temperature 0.8 --edit ""
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from engine.bench import BenchPrompt, Run, load_prompts, run_once

MODES = ("plain", "drafter", "drafter+old reply")


def pick(prompts: Sequence[BenchPrompt], per_category: int) -> list[BenchPrompt]:
    """The first `per_category` prompts of each category, in file order."""
    seen: dict[str, int] = defaultdict(int)
    out = []
    for p in prompts:
        if seen[p.category] < per_category:
            seen[p.category] += 1
            out.append(p)
    return out


def edited(messages: Sequence[dict], edit: str) -> list[dict]:
    """The conversation with `edit` appended to its last message."""
    *head, last = messages
    return [*head, {**last, "content": last["content"] + edit}]


def main(argv: Sequence[str] | None = None) -> int:
    from engine.decode import ChatSession, GenerateOptions
    from engine.loading import load_model
    from engine.sampling import SamplingParams
    from resources import resource_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--prompts", type=Path, default=None)
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--edit", default=" Thanks!")
    parser.add_argument("--drafter", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    path = args.prompts or resource_path("bench", "prompts.jsonl")
    prompts = pick(load_prompts(Path(path)), args.per_category)
    session = ChatSession(load_model(args.model))

    def reply(messages: list[dict], drafter: str, seed: int, reference: str = "") -> Run:
        return run_once(session, messages, GenerateOptions(
            max_tokens=args.max_tokens, drafter=drafter, reference=reference,
            sampling=SamplingParams(temperature=args.temperature, seed=seed)))

    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for p in prompts:
        first = reply(p.messages, "none", 1)
        again = edited(p.messages, args.edit)
        runs = {"plain": reply(again, "none", 2),
                "drafter": reply(again, args.drafter, 2),
                "drafter+old reply": reply(again, args.drafter, 2, first.text)}
        for mode, f in runs.items():
            if f.text != runs["plain"].text:
                raise SystemExit(f"{p.id}: {mode} wrote another text than plain")
            for key in (p.category, "all"):
                totals[key][f"{mode} tokens"] += f.stats.generated_tokens
                totals[key][f"{mode} s"] += f.stats.decode_s
                totals[key][f"{mode} passes"] += f.stats.target_passes
    for key, t in sorted(totals.items()):
        tps = {m: t[f"{m} tokens"] / t[f"{m} s"] for m in MODES}
        tau = {m: t[f"{m} tokens"] / t[f"{m} passes"] for m in MODES}
        print(f"{key:16s} plain {tps['plain']:5.1f} tok/s | {args.drafter} "
              f"x{tps['drafter'] / tps['plain']:.2f} (tau {tau['drafter']:.2f}) | with the "
              f"old reply x{tps['drafter+old reply'] / tps['plain']:.2f} "
              f"(tau {tau['drafter+old reply']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
