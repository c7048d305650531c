"""The reference bench (tools/reference_bench.py): its three modes write one text, and
the old reply is drafted from."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.engine.test_decode import write_chain_model
from tools.reference_bench import main


def test_drafting_from_the_old_reply_takes_fewer_passes(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    chain = write_chain_model(tmp_path / "chain")  # greedy: the same reply to any prompt
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(
        {"id": f"p{i}", "category": "chat",
         "messages": [{"role": "user", "content": f"Say hello {i}"}]}) for i in range(2)))
    assert main(["--model", str(chain), "--prompts", str(prompts), "--drafter", "ngram",
                 "--max-tokens", "40"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("all"))
    taus = [float(t) for t in re.findall(r"tau (\d+\.\d+)", row)]
    assert len(taus) == 2 and taus[1] >= 3 * taus[0], row  # the control: ngram alone ~1
