"""The harness behind `understudy bench`: plain vs speculative, in one process.

Each prompt runs in every mode after one warm-up reply per mode. The modes' replies to a
prompt are generated side by side, taking turns every few steps (`engine.turns`), so both
see the same moments of the machine. Speedups are ratios of decode times measured in the
same run; never compare figures across runs or machines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.decode import ChatSession, GenerateOptions
from engine.drafters.head_io import head_for_drafter
from engine.errors import EngineError
from engine.events import Finished, Stats
from engine.sampling import SamplingParams
from engine.tokenizer import check_messages
from engine.tuning import K_MAX, CostModel, row_budget
from engine.turns import take_turns
from resources import resource_path

DEFAULT_PROMPTS = resource_path("bench", "prompts.jsonl")
MODES = ("plain", "chain", "spec")  # chain: spec with draft trees off (trees vs chains)
SLICE_STEPS = 8  # steps one mode runs before the next mode's turn (about a second here)
BOOTSTRAP_RESAMPLES = 2000


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    messages: list[dict[str, str]]
    # text the reply is expected to repeat (a predicted output): the drafting modes'
    # reference (`GenerateOptions.reference`); "" for none
    prediction: str = ""


@dataclass
class Run:
    """One reply in one mode."""

    text: str
    stats: Stats


@dataclass
class Totals:
    """Summed counts over a set of prompts; ratios come out as properties."""

    plain_tokens: int = 0
    plain_s: float = 0.0
    spec_tokens: int = 0
    spec_s: float = 0.0
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    n_identical: int = 0
    n: int = 0
    chain_tokens: int = 0
    chain_s: float = 0.0
    chain_passes: int = 0
    chain_drafted: int = 0
    chain_accepted: int = 0
    n_chain_identical: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    # per prompt with both modes: (plain tokens, plain s, spec tokens, spec s)
    pairs: list[tuple[int, float, int, float]] = field(default_factory=list)

    def add(self, plain: Run | None, spec: Run | None, chain: Run | None = None) -> None:
        self.n += 1
        if chain is not None:
            self.chain_tokens += chain.stats.generated_tokens
            self.chain_s += chain.stats.decode_s
            self.chain_passes += chain.stats.target_passes
            self.chain_drafted += chain.stats.n_drafted
            self.chain_accepted += chain.stats.n_accepted
            self.n_chain_identical += plain is not None and plain.text == chain.text
        if plain is not None and spec is not None:
            self.pairs.append((plain.stats.generated_tokens, plain.stats.decode_s,
                               spec.stats.generated_tokens, spec.stats.decode_s))
        if plain is not None:
            self.plain_tokens += plain.stats.generated_tokens
            self.plain_s += plain.stats.decode_s
            self.prompt_tokens += plain.stats.prefilled_tokens
            self.prompt_s += plain.stats.prompt_s
        if spec is not None:
            self.spec_tokens += spec.stats.generated_tokens
            self.spec_s += spec.stats.decode_s
            self.passes += spec.stats.target_passes
            self.drafted += spec.stats.n_drafted
            self.accepted += spec.stats.n_accepted
        if plain is not None and spec is not None and plain.text == spec.text:
            self.n_identical += 1

    def row(self) -> dict[str, float | bool | None]:
        plain_tps = self.plain_tokens / self.plain_s if self.plain_s else None
        spec_tps = self.spec_tokens / self.spec_s if self.spec_s else None
        speedup = spec_tps / plain_tps if plain_tps and spec_tps else None
        return {
            "plain_tps": plain_tps,
            "spec_tps": spec_tps,
            "speedup": speedup,
            "tau": self.spec_tokens / self.passes if self.passes else None,
            "acceptance": self.accepted / self.drafted if self.drafted else None,
            "identical": self.n_identical == self.n if self.spec_tokens and self.plain_tokens
            else None,
            "prompt_tps": self.prompt_tokens / self.prompt_s if self.prompt_s else None,
            "plain_tokens": self.plain_tokens,
            "spec_tokens": self.spec_tokens,
            "speedup_ci95": self.speedup_interval(),
            **self._chain_row(spec_tps, plain_tps),
            **self.extra,
        }

    def _chain_row(self, spec_tps: float | None, plain_tps: float | None) -> dict:
        """The chain mode's figures (spec with trees off), when it ran: trees vs chains."""
        if not self.chain_s:
            return {}
        chain_tps = self.chain_tokens / self.chain_s
        chain_tau = self.chain_tokens / self.chain_passes if self.chain_passes else None
        tau = self.spec_tokens / self.passes if self.passes else None
        return {
            "chain_tps": chain_tps,
            "chain_speedup": chain_tps / plain_tps if plain_tps else None,
            "chain_tau": chain_tau,
            "chain_acceptance": (self.chain_accepted / self.chain_drafted
                                 if self.chain_drafted else None),
            "trees_vs_chains": spec_tps / chain_tps if spec_tps else None,
            # issue 13's goal is stated in tokens per pass (equal pass count), not speed
            "tau_trees_vs_chains": tau / chain_tau if tau and chain_tau else None,
            "chain_identical": self.n_chain_identical == self.n if self.plain_tokens else None,
        }

    def speedup_interval(self, level: float = 0.95) -> list[float] | None:
        """A percentile-bootstrap interval for the aggregate speedup, resampling prompts.

        Why: on a shared machine one run's speedup moves by a percent or two with the load,
        and prompts differ; the interval says whether a figure near 1.0 is a difference or
        noise. Seeded, so a report is reproducible from its own numbers. None for fewer
        than two prompts.
        """
        if len(self.pairs) < 2:
            return None
        rng = random.Random(0)
        stats = []
        for _ in range(BOOTSTRAP_RESAMPLES):
            sample = rng.choices(self.pairs, k=len(self.pairs))
            plain_tps = sum(p[0] for p in sample) / sum(p[1] for p in sample)
            spec_tps = sum(p[2] for p in sample) / sum(p[3] for p in sample)
            stats.append(spec_tps / plain_tps)
        stats.sort()
        tail = (1.0 - level) / 2
        return [stats[int(tail * (len(stats) - 1))], stats[int((1 - tail) * (len(stats) - 1))]]


def load_prompts(path: Path) -> list[BenchPrompt]:
    """Read JSON lines {id, category, messages[, prediction]}; errors name the line."""
    out: list[BenchPrompt] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise EngineError(f"{path}: cannot read prompts file ({e.strerror})") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise EngineError(f"{path}:{i}: not valid JSON ({e})") from None
        missing = [k for k in ("id", "category", "messages") if not isinstance(obj, dict)
                   or k not in obj]
        if missing:
            raise EngineError(f"{path}:{i}: expected {{id, category, messages}}; missing "
                              f"{', '.join(missing)}")
        messages = check_messages(obj["messages"], f"{path}:{i}: messages")
        prediction = obj.get("prediction", "")
        if not isinstance(prediction, str):
            raise EngineError(f"{path}:{i}: prediction must be text (a JSON string), got "
                              f"{type(prediction).__name__}")
        out.append(BenchPrompt(str(obj["id"]), str(obj["category"]), list(messages),
                               prediction))
    if not out:
        raise EngineError(f"{path}: no prompts")
    return out


def run_once(session: ChatSession, messages: list[dict[str, str]],
             options: GenerateOptions) -> Run:
    """One reply from a cold cache (no prefix reuse between measured runs)."""
    session.reset()
    finished = None
    for ev in session.generate(messages, options):
        if isinstance(ev, Finished):
            finished = ev
    assert finished is not None
    return Run(finished.text, finished.stats)


def run_side_by_side(sessions: Mapping[str, ChatSession], messages: list[dict[str, str]],
                     options: Mapping[str, GenerateOptions], order: Sequence[str]) -> dict[str, Run]:
    """Every mode's reply to one prompt from cold caches, the modes taking turns of
    SLICE_STEPS steps (`engine.turns`); each mode's decode time is its own turns only."""
    streams = {}
    for mode in order:
        sessions[mode].reset()
        streams[mode] = sessions[mode].generate(messages, options[mode])
    runs: dict[str, Run] = {}
    for turn in take_turns(streams, lambda steps, _seconds: steps >= SLICE_STEPS):
        if isinstance(turn.event, Finished):
            f = turn.event
            runs[turn.name] = Run(f.text, replace(f.stats, decode_s=turn.own_s))
    return runs


def mlx_lm_decode_tps(model_path: Path, prompts: Sequence[BenchPrompt], max_tokens: int) -> float:
    """mlx-lm's own plain decode speed over the same prompts (same folder, its own loader)."""
    try:
        from mlx_lm import load, stream_generate
    except ImportError:
        raise EngineError("--compare-mlx-lm needs mlx-lm: pip install mlx-lm") from None
    model, tokenizer = load(str(model_path))
    total_tokens, total_s = 0, 0.0
    for i, p in enumerate([prompts[0], *prompts]):
        prompt = tokenizer.apply_chat_template(p.messages, add_generation_prompt=True)
        responses = list(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens))
        last = responses[-1] if responses else None
        if i == 0 or last is None:  # warm-up
            continue
        total_tokens += last.generation_tokens
        total_s += last.generation_tokens / max(last.generation_tps, 1e-9)
    return total_tokens / total_s if total_s else 0.0


def run_bench(session: ChatSession, prompts: Sequence[BenchPrompt], modes: Iterable[str],
              spec_options: GenerateOptions, log=None) -> dict:
    """Run every prompt in every mode (side by side); return the report dict."""
    modes = tuple(modes)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise EngineError(f"--modes: unknown mode(s) {', '.join(bad)} (use plain,chain,spec)")
    plain_options = GenerateOptions(max_tokens=spec_options.max_tokens,
                                    sampling=spec_options.sampling, stop=spec_options.stop)
    options = {"plain": plain_options, "spec": spec_options,
               "chain": replace(spec_options, tree="off")}
    # plain replies get their own caches over the same loaded weights
    sessions = {"spec": session, "plain": ChatSession(session.target) if "spec" in modes
                else session}
    if "chain" in modes:
        sessions["chain"] = ChatSession(session.target, session.draft, session.head)
    for m in modes:  # warm-up: compile, allocate, calibrate
        run_once(sessions[m], prompts[0].messages, options[m])
    rows, categories, overall = [], {}, Totals()
    for i, p in enumerate(prompts):
        order = modes if i % 2 == 0 else tuple(reversed(modes))
        runs = run_side_by_side(sessions, p.messages, {
            m: replace(o, reference=p.prediction) for m, o in options.items()}, order)
        t = Totals()
        got = (runs.get("plain"), runs.get("spec"), runs.get("chain"))
        t.add(*got)
        overall.add(*got)
        categories.setdefault(p.category, Totals()).add(*got)
        row = {"id": p.id, "category": p.category, **t.row()}
        rows.append(row)
        if log is not None:
            log(_format_row(row))
    return {"prompts": rows,
            "categories": {c: t.row() for c, t in categories.items()},
            "overall": overall.row()}


def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _format_row(r: dict) -> str:
    ci = r.get("speedup_ci95")
    interval = f"  95% CI x{ci[0]:.2f}-{ci[1]:.2f}" if ci else ""
    return (f"{r.get('id', ''):<24} {r.get('category', ''):<14} plain {_fmt(r['plain_tps']):>7} "
            f"spec {_fmt(r['spec_tps']):>7} tok/s  x{_fmt(r['speedup'], '.2f'):>5}  "
            f"tau {_fmt(r['tau'], '.2f'):>5}  acc {_fmt(r['acceptance'], '.2f'):>4}  "
            f"prompt {_fmt(r['prompt_tps']):>7} tok/s  "
            f"{'identical' if r['identical'] else ('' if r['identical'] is None else 'DIFFERENT')}"
            f"{interval}{_format_chain(r)}")


def _format_chain(r: dict) -> str:
    """The chain mode's part of a row: its speed, tau, and trees vs chains."""
    if "chain_tps" not in r:
        return ""
    same = {True: " identical", False: " DIFFERENT", None: ""}[r["chain_identical"]]
    return (f"\n{'':<24} {'':<14} chain {_fmt(r['chain_tps']):>7} tok/s  "
            f"x{_fmt(r['chain_speedup'], '.2f'):>5}  tau {_fmt(r['chain_tau'], '.2f'):>5}  "
            f"acc {_fmt(r['chain_acceptance'], '.2f'):>4}  trees/chains "
            f"x{_fmt(r['trees_vs_chains'], '.3f')} (tau x{_fmt(r['tau_trees_vs_chains'], '.3f')})"
            f"{same}")


def describe_corrections(corrections: Sequence[tuple[int, float, float]],
                         shown: int = 6) -> str:
    """One line saying how live passes corrected the calibrated cost table, so a user whose
    speedup moved knows why (a stale calibration.json, or the machine's load changed)."""
    parts = [f"width {w}: {old:.3f} s -> {new:.3f} s" for w, old, new in corrections[:shown]]
    more = f" (+{len(corrections) - shown} more)" if len(corrections) > shown else ""
    return "cost table corrected by live passes: " + ", ".join(parts) + more


def _span(widths: list[int]) -> str:
    """"11-15" for a run of consecutive widths, "4" for one, "3, 5" otherwise."""
    if len(widths) == 1:
        return str(widths[0])
    if widths == list(range(widths[0], widths[-1] + 1)):
        return f"{widths[0]}-{widths[-1]}"
    return ", ".join(map(str, widths))


def describe_padding(costs: CostModel) -> str | None:
    """One line naming the pass widths run wider because the wider pass costs less here
    (`CostModel.pad_width`), or None: it explains a speedup that a width's own timing
    would not, and tells the user the padding is on. A width is shown as a chain of that
    width pads it, within the chain's own row budget: a narrow chain may not reach the
    cheapest width of the whole table."""
    runs: dict[int, list[int]] = {}
    for width in range(2, K_MAX + 2):
        pad = costs.pad_width(width, row_budget(width - 1))
        if pad != width:
            runs.setdefault(pad, []).append(width)
    if not runs:
        return None
    parts = [f"{_span(ws)} rows as {pad}" for pad, ws in sorted(runs.items())]
    return "passes padded where a wider one costs less: " + ", ".join(parts)


def check_report_path(path: Path) -> None:
    """Refuse a report path that cannot be written before the run, not after it: a run
    takes minutes, and a failed write at the end loses its results."""
    if path.is_dir():
        raise EngineError(f"--json {path}: is a folder; give a file name for the report")
    folder = path.parent
    if not folder.is_dir():
        raise EngineError(f"--json {path}: folder {folder} does not exist")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise EngineError(f"--json {path}: not writable")


def run_cli(args: argparse.Namespace) -> int:
    """`understudy bench`: print a table, optionally write the JSON report."""
    from engine.loading import load_model

    if args.limit is not None and args.limit < 1:
        raise EngineError(f"--limit must be at least 1, got {args.limit}")
    if args.json is not None:
        check_report_path(args.json)
    prompts = load_prompts(args.prompts or DEFAULT_PROMPTS)
    categories = sorted({p.category for p in prompts})
    if args.category:
        prompts = [p for p in prompts if p.category in args.category]
    if args.limit is not None:
        prompts = prompts[: args.limit]
    if not prompts:
        raise EngineError("no prompts left after --category/--limit (categories: "
                          f"{', '.join(categories)})")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    drafter = args.drafter
    try:
        k = None if args.k == "auto" else int(args.k)
    except ValueError:
        raise EngineError(f"--k must be 'auto' or a number, got {args.k!r}") from None
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
    options = GenerateOptions(max_tokens=args.max_tokens, sampling=sampling, drafter=drafter,
                              k=k, accept=args.accept, tree=args.tree)
    target = load_model(args.model)
    draft = load_model(args.draft) if args.draft else None
    session = ChatSession(target, draft, head_for_drafter(target, drafter))
    print(f"model {target.name} ({target.backend}), drafter {drafter}, k {args.k}, "
          f"tree {args.tree}, "
          f"{len(prompts)} prompts, modes {','.join(modes)}", file=sys.stderr)
    report = run_bench(session, prompts, modes, options, log=print)
    if args.compare_mlx_lm:
        ref = mlx_lm_decode_tps(target.path, prompts, args.max_tokens)
        ours = report["overall"]["plain_tps"]
        report["overall"]["mlx_lm_plain_tps"] = ref
        report["overall"]["plain_vs_mlx_lm"] = ours / ref if ours and ref else None
    print("-" * 100)
    for c, row in report["categories"].items():
        print(_format_row({"id": "[category]", "category": c, **row}))
    print(_format_row({"id": "[overall]", "category": "", **report["overall"]}))
    if args.compare_mlx_lm:
        o = report["overall"]
        print(f"mlx-lm plain decode {_fmt(o['mlx_lm_plain_tps'])} tok/s; ours/mlx-lm "
              f"x{_fmt(o['plain_vs_mlx_lm'], '.2f')}")
    if session.costs is not None and session.costs.corrections:
        print(describe_corrections(session.costs.corrections), file=sys.stderr)
    padding = describe_padding(session.costs) if session.costs is not None else None
    if padding:
        print(padding, file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0
