#!/usr/bin/env bash
# One command from a fresh clone to a served model:  bash launch/serve.sh [CONFIG] [serve flags...]
# Installs into ./.venv, then runs torchrun on this host with one process per rank of CONFIG
# (default launch/configs/smollm2_pd.yaml: prefill on rank 0, decode on rank 1, CPU) on http://127.0.0.1:8000.
# Env: NPROC (processes on this host; default: the config's rank count), MASTER_PORT (default 29500).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="${1:-$repo/launch/configs/smollm2_pd.yaml}"
[ $# -gt 0 ] && shift
venv="$(bash "$repo/launch/install.sh" | tail -n 1)"
nproc="${NPROC:-$("$venv/bin/python" - "$config" <<'PY'
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
print(max(r for g in cfg["node_groups"] for r in g["ranks"]) + 1)
PY
)}"
cd "$repo"
exec "$venv/bin/torchrun" --standalone --nproc-per-node "$nproc" --master-port "${MASTER_PORT:-29500}" \
  -m mstar_dist.serve "$config" "$@"
