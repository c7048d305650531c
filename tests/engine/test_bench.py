"""`understudy bench` end to end on a tiny target/draft pair: the report's shape and sense."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from app.cli import main
from engine.bench import (
    DEFAULT_PROMPTS,
    BenchPrompt,
    Run,
    Totals,
    load_prompts,
    run_bench,
    run_once,
    run_side_by_side,
)
from engine.decode import ChatSession, GenerateOptions
from engine.errors import EngineError
from engine.events import Stats
from engine.loading import load_model
from engine.sampling import SamplingParams
from tests.fixtures.tiny_models import write_tiny_pair

METRICS = {"plain_tps", "spec_tps", "speedup", "tau", "acceptance", "identical"}
PROMPTS = [
    BenchPrompt("greet", "chat", [{"role": "user", "content": "Hello world! The quick fox"}]),
    BenchPrompt("add", "code", [{"role": "user", "content": "def add(a, b):\n    return"}]),
    BenchPrompt("paris", "chat", [{"role": "user", "content": "What is the capital of France?"}]),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_tiny_pair(tmp_path_factory.mktemp("bench"))


@pytest.fixture(scope="module")
def session(pair: tuple[Path, Path]) -> ChatSession:
    return ChatSession(load_model(str(pair[0])), load_model(str(pair[1])))


def check_report(report: dict, ids: list[str], categories: set[str]) -> None:
    """The contract: prompts[], categories{}, overall{}, every row with the same metrics."""
    assert set(report) == {"prompts", "categories", "overall"}
    assert [r["id"] for r in report["prompts"]] == ids
    assert set(report["categories"]) == categories
    rows = [*report["prompts"], *report["categories"].values(), report["overall"]]
    fields = set(report["overall"])
    assert fields >= METRICS
    for row in report["prompts"]:
        assert set(row) == fields | {"id", "category"}
        assert row["category"] in categories
    for row in rows:
        assert set(row) >= METRICS
        assert row["plain_tps"] > 0 and row["spec_tps"] > 0
        assert row["speedup"] == pytest.approx(row["spec_tps"] / row["plain_tps"])
        assert row["tau"] >= 1.0
        assert 0.0 <= row["acceptance"] <= 1.0
        assert isinstance(row["identical"], bool)
    assert json.loads(json.dumps(report)) == report  # plain JSON all the way down


def totals_of(pairs: list[tuple[float, float]]) -> Totals:
    """Totals over prompts of 100 tokens each, timed (plain s, spec s)."""
    t = Totals()
    for plain_s, spec_s in pairs:
        t.add(Run("x", Stats(generated_tokens=100, decode_s=plain_s)),
              Run("x", Stats(generated_tokens=100, decode_s=spec_s)))
    return t


def test_speedup_interval_says_whether_a_figure_near_one_is_noise() -> None:
    # six prompts at parity give or take 2%: the interval straddles 1.0
    noisy = totals_of([(10.0, 10.2), (10.0, 9.8), (10.0, 10.1), (10.0, 9.9), (10.0, 10.2),
                       (10.0, 9.8)])
    lo, hi = noisy.row()["speedup_ci95"]
    assert lo < 1.0 < hi and hi - lo < 0.05
    assert lo <= noisy.row()["speedup"] <= hi
    # every prompt twice as fast: a point interval at 2.0
    assert totals_of([(10.0, 5.0)] * 4).row()["speedup_ci95"] == pytest.approx([2.0, 2.0])
    # a consistent 5% gain with the same spread excludes 1.0 (negative control for the above)
    gain = totals_of([(10.5, 10.2), (10.5, 9.8), (10.5, 10.1), (10.5, 9.9), (10.5, 10.2),
                      (10.5, 9.8)])
    assert gain.row()["speedup_ci95"][0] > 1.0
    # reproducible, and absent below two prompts
    assert noisy.speedup_interval() == noisy.speedup_interval()
    assert totals_of([(10.0, 9.0)]).row()["speedup_ci95"] is None


def test_run_bench_report(session: ChatSession) -> None:
    lines: list[str] = []
    options = GenerateOptions(max_tokens=16, drafter="model", k=3)
    report = run_bench(session, PROMPTS, ("plain", "spec"), options, log=lines.append)
    check_report(report, ["greet", "add", "paris"], {"chat", "code"})
    assert all(r["identical"] is True for r in report["prompts"])  # coupled: same text
    assert report["overall"]["identical"] is True
    assert len(lines) == 3 and "greet" in lines[0] and "identical" in lines[0]


def test_side_by_side_replies_equal_one_at_a_time_replies(session: ChatSession) -> None:
    """Taking turns must not let the modes disturb each other: same texts and token counts
    as replies generated alone, and each mode's time is its own turns only."""
    plain_session = ChatSession(session.target)
    options = {"plain": GenerateOptions(max_tokens=24),
               "spec": GenerateOptions(max_tokens=24, drafter="model", k=2)}
    sessions = {"plain": plain_session, "spec": session}
    for p in PROMPTS:
        alone = {m: run_once(sessions[m], p.messages, options[m]) for m in options}
        t0 = time.perf_counter()
        together = run_side_by_side(sessions, p.messages, options, ("spec", "plain"))
        wall = time.perf_counter() - t0
        for m in options:
            assert together[m].text == alone[m].text
            assert together[m].stats.generated_tokens == alone[m].stats.generated_tokens
            assert together[m].stats.target_passes == alone[m].stats.target_passes
            assert together[m].stats.decode_s > 0
        # each mode is charged only its own turns: the two add up to less than the whole
        assert sum(r.stats.decode_s for r in together.values()) < wall
        assert together["plain"].stats.target_passes == together["plain"].stats.generated_tokens


def test_run_bench_flags_different_text(session: ChatSession) -> None:
    """Under the rejection rule at temperature > 0 the texts may differ, and the flag says so."""
    options = GenerateOptions(max_tokens=16, drafter="model", k=3, accept="rejection",
                              sampling=SamplingParams(temperature=1.0, seed=1))
    report = run_bench(session, PROMPTS, ("plain", "spec"), options)
    flags = [r["identical"] for r in report["prompts"]]
    assert False in flags
    assert report["overall"]["identical"] is False


def test_bench_cli_prints_and_writes_json(pair: tuple[Path, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": p.id, "category": p.category,
                                             "messages": p.messages}) for p in PROMPTS) + "\n")
    out = tmp_path / "report.json"
    rc = main(["bench", "--model", str(pair[0]), "--draft", str(pair[1]), "--drafter", "model",
               "--k", "2", "--prompts", str(prompts), "--max-tokens", "12", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    check_report(report, ["greet", "add", "paris"], {"chat", "code"})
    assert report["overall"]["identical"] is True
    printed = capsys.readouterr().out
    assert "greet" in printed and "[overall]" in printed


def test_bench_cli_limit_and_category(pair: tuple[Path, Path], tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": p.id, "category": p.category,
                                             "messages": p.messages}) for p in PROMPTS))
    out = tmp_path / "report.json"
    rc = main(["bench", "--model", str(pair[0]), "--drafter", "ngram", "--k", "3",
               "--prompts", str(prompts), "--category", "chat", "--limit", "1",
               "--max-tokens", "8", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["id"] for r in report["prompts"]] == ["greet"]
    assert set(report["categories"]) == {"chat"}


def test_load_prompts_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    good = '{"id": "a", "category": "c", "messages": [{"role": "user", "content": "hi"}]}'
    path.write_text(good + '\n{"id": "b"}\n')
    with pytest.raises(EngineError, match=r"p\.jsonl:2: .*missing category, messages"):
        load_prompts(path)
    for bad, said in (('"messages": []', r":1: messages: expected a non-empty list"),
                      ('"messages": "hi"', r":1: messages: expected a non-empty list"),
                      ('"messages": [{"role": "user", "content": 3}]',
                       r":1: messages\[0\]: 'content' must be a string")):
        path.write_text('{"id": "a", "category": "c", ' + bad + "}\n")
        with pytest.raises(EngineError, match=said):
            load_prompts(path)
    path.write_text(good + "\nnot json\n")
    with pytest.raises(EngineError, match=r"p\.jsonl:2: not valid JSON"):
        load_prompts(path)
    path.write_text(good + "\n")
    assert [p.id for p in load_prompts(path)] == ["a"]  # the control: a good file loads
    path.write_text(good[:-1] + ', "prediction": ["x"]}\n')
    with pytest.raises(EngineError, match=r"p\.jsonl:1: prediction must be text"):
        load_prompts(path)
    path.write_text(good[:-1] + ', "prediction": "hi there"}\n')
    assert load_prompts(path)[0].prediction == "hi there"
    path.write_text("\n\n")
    with pytest.raises(EngineError, match="no prompts"):
        load_prompts(path)
    with pytest.raises(EngineError, match="cannot read"):
        load_prompts(tmp_path / "missing.jsonl")


def test_a_prompts_prediction_is_what_the_drafting_modes_draft_from(tmp_path: Path) -> None:
    """A bench prompt may carry a predicted output: spec and chain draft from it (far
    fewer passes than without one), and the text stays plain decoding's."""
    from tests.engine.test_decode import CHAIN_TEXT, write_chain_model

    chain = ChatSession(load_model(str(write_chain_model(tmp_path / "chain"))))
    messages = [{"role": "user", "content": "Hi"}]
    prompts = [BenchPrompt("with", "predicted", messages, CHAIN_TEXT),
               BenchPrompt("without", "unpredicted", messages)]
    options = GenerateOptions(max_tokens=40, drafter="ngram")
    report = run_bench(chain, prompts, ("plain", "spec", "chain"), options)
    rows = {r["id"]: r for r in report["prompts"]}
    assert all(r["identical"] for r in rows.values())
    assert rows["with"]["tau"] >= 3 * rows["without"]["tau"], rows


def test_unknown_mode_is_refused(session: ChatSession) -> None:
    with pytest.raises(EngineError, match="unknown mode"):
        run_bench(session, PROMPTS, ("plain", "turbo"), GenerateOptions(drafter="ngram", k=2))


def test_bundled_prompts_load() -> None:
    prompts = load_prompts(DEFAULT_PROMPTS)
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({p.category for p in prompts}) >= 3
    assert all(p.messages and p.messages[-1]["role"] == "user" for p in prompts)
