"""`understudy bench --modes plain,chain,spec`: trees and chains measured in one run."""

from __future__ import annotations

import pytest

from engine.bench import BenchPrompt, run_bench
from engine.decode import ChatSession, GenerateOptions
from engine.loading import load_model
from engine.sampling import SamplingParams
from tests.fixtures.tiny_models import write_tiny_model

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a, b):"
PROMPTS = [BenchPrompt("add", "code", [{"role": "user", "content": CODE}]),
           BenchPrompt("hi", "chat", [{"role": "user", "content": "Hello world! The cat"}])]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> ChatSession:
    return ChatSession(load_model(str(write_tiny_model(tmp_path_factory.mktemp("tb") / "t"))))


def test_chain_mode_reports_trees_vs_chains(session: ChatSession) -> None:
    lines: list[str] = []
    options = GenerateOptions(max_tokens=12, drafter="ngram",
                              sampling=SamplingParams(temperature=0.8, seed=3))
    report = run_bench(session, PROMPTS, ("plain", "chain", "spec"), options,
                       log=lines.append)
    for row in [*report["prompts"], report["overall"]]:
        assert row["identical"] is True and row["chain_identical"] is True
        assert row["chain_tps"] > 0 and row["trees_vs_chains"] > 0
        assert row["trees_vs_chains"] == pytest.approx(row["spec_tps"] / row["chain_tps"])
        assert row["chain_tau"] >= 1.0
        assert row["tau_trees_vs_chains"] == pytest.approx(row["tau"] / row["chain_tau"])
    assert "trees/chains" in lines[0] and "chain" in lines[0] and "(tau x" in lines[0]
    # without the chain mode the report has no chain figures (negative control)
    plain_spec = run_bench(session, PROMPTS[:1], ("plain", "spec"), options)
    assert "trees_vs_chains" not in plain_spec["overall"]
