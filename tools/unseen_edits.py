"""Code-editing prompts nobody wrote for this project: Python standard-library functions
drawn with a seed, each with a generic edit, as `understudy bench --prompts` reads them.

Why: the bundled code-editing prompts are the ones the tree policy was read on, so a figure
from them flatters it. Judged on prompts never seen, a change has to generalize. The
functions come from the running Python's own standard library (top-level functions of 6-24
lines without decorators), so any machine draws the same set for a seed and Python version.

    python -m tools.unseen_edits SEED N OUT.jsonl
    understudy bench --model demo --max-tokens 128 --modes plain,spec,chain --drafter ngram \\
        --prompts OUT.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MIN_LINES, MAX_LINES, MAX_WIDTH = 6, 24, 100
REPLY_RULE = "Reply with the full updated code only."


@dataclass(frozen=True)
class Function:
    module: str
    name: str
    source: str
    variables: tuple[str, ...]  # names it assigns (longer than one letter), sorted


def stdlib_functions(lib: Path | None = None) -> list[Function]:
    """Every candidate function of the standard library's top-level modules, in a fixed
    order (module file name, then position)."""
    lib = lib or Path(sysconfig.get_paths()["stdlib"])
    found = []
    for file in sorted(lib.glob("*.py")):
        try:
            source = file.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.decorator_list:
                continue
            body = lines[node.lineno - 1:node.end_lineno]
            if not MIN_LINES <= len(body) <= MAX_LINES or max(map(len, body)) >= MAX_WIDTH:
                continue
            names = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                            and isinstance(n.ctx, ast.Store) and len(n.id) > 1})
            found.append(Function(file.stem, node.name, "\n".join(body), tuple(names)))
    return found


def edits_for(fn: Function, rng: random.Random) -> list[str]:
    edits = ["Add type hints to this function.",
             "Add a one-line docstring to this function.",
             f"Rename the function `{fn.name}` to `{fn.name}_checked`."]
    if fn.variables:
        name = rng.choice(fn.variables)
        edits.append(f"Rename the variable `{name}` to `{name}_value`.")
    return edits


def draw(seed: int, n: int, functions: list[Function] | None = None) -> list[dict]:
    """`n` bench prompts (id, category, messages) for `seed`."""
    rng = random.Random(seed)
    pool = stdlib_functions() if functions is None else functions
    prompts = []
    for i, fn in enumerate(rng.sample(pool, n)):
        edit = rng.choice(edits_for(fn, rng))
        content = f"{edit} {REPLY_RULE}\n\n```python\n{fn.source}\n```"
        prompts.append({"id": f"u{seed}-{i}-{fn.module}-{fn.name}", "category": "code-editing",
                        "messages": [{"role": "user", "content": content}]})
    return prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.unseen_edits",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("seed", type=int)
    parser.add_argument("n", type=int)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    prompts = draw(args.seed, args.n)
    args.out.write_text("".join(json.dumps(p) + "\n" for p in prompts), encoding="utf-8")
    print(f"{len(prompts)} prompts written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
