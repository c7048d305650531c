"""The unseen code-edit prompt generator (tools/unseen_edits.py)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.bench import load_prompts
from tools.unseen_edits import MAX_LINES, MIN_LINES, draw, main, stdlib_functions


def test_a_seed_draws_the_same_bench_ready_prompts_and_another_seed_others(
        tmp_path: Path) -> None:
    pool = stdlib_functions()
    assert len(pool) > 200  # the standard library offers plenty
    assert all(MIN_LINES <= len(f.source.splitlines()) <= MAX_LINES for f in pool)
    assert all(f.source.startswith(f"def {f.name}(") for f in pool)
    first, again, other = draw(7, 12, pool), draw(7, 12, pool), draw(8, 12, pool)
    assert first == again
    assert {p["id"] for p in first} != {p["id"] for p in other}  # the control
    assert len({p["id"] for p in first}) == 12
    out = tmp_path / "set.jsonl"
    assert main(["7", "12", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == first
    loaded = load_prompts(out)  # what `understudy bench --prompts` reads
    assert [p.id for p in loaded] == [p["id"] for p in first]
    assert all(p.category == "code-editing" for p in loaded)
    for p in first:
        content = p["messages"][0]["content"]
        assert "```python\ndef " in content and content.endswith("```")
