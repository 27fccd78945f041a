#!/usr/bin/env bash
# One command from a fresh clone to a tested tree:  bash scripts/test.sh [pytest args...]
# Installs ./.venv with the [test] extras (see launch/install.sh), then runs the whole suite.
# pytest exit code 5 (no tests collected) counts as a failure.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$repo/launch/install.sh" --test | tail -n 1)" || exit 1
cd "$repo"
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
rc=$?
[ "$rc" -eq 5 ] && { echo "pytest collected no tests"; exit 1; }
exit "$rc"
