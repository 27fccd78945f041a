#!/usr/bin/env bash
# One command from a fresh clone to a served model:  bash launch/serve.sh [CONFIG] [serve flags...]
# Installs into ./.venv (skipped when nothing changed), checks CONFIG, then runs torchrun on this host with one
# process per rank of CONFIG (default launch/configs/smollm2_pd.yaml: prefill on rank 0, decode on rank 1, CPU)
# on http://127.0.0.1:8000. CONFIG may be relative to the folder you run this from.
# Env: NPROC (processes on this host; default: the config's rank count), MASTER_PORT (default 29500).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage="usage: bash launch/serve.sh [CONFIG.yaml] [flags...]  (e.g. bash launch/serve.sh launch/configs/smollm2_single.yaml --port 8001)"
config="$repo/launch/configs/smollm2_pd.yaml"
if [ $# -gt 0 ]; then
  case "$1" in
    -h|--help) echo "$usage"; exit 0 ;;
    -*) echo "serve.sh: error: the first argument must be a deployment YAML, got the flag '$1'; $usage" >&2; exit 2 ;;
  esac
  config="$1"
  shift
  case "$config" in /*) ;; *) config="$PWD/$config" ;; esac  # relative to the caller's folder, before the cd
fi
[ -f "$config" ] || { echo "serve.sh: error: $config: no such file; $usage" >&2; exit 2; }
venv="$(bash "$repo/launch/install.sh" | tail -n 1)"
cd "$repo"
# Check the config (and flags) and the HTTP port once, before torchrun starts ranks: a mistake is one line, not one
# per rank.
"$venv/bin/python" -m mstar_dist.serve "$config" --dry-run --check-port "$@" >/dev/null || exit 2
nproc="${NPROC:-$("$venv/bin/python" -c 'import sys
from mstar_dist.config.deployment import load_config
cfg = load_config(sys.argv[1])
print(cfg.cluster.world_size if cfg.cluster else 1 + max(r for g in cfg.node_groups for r in g.ranks))' "$config")}"
exec "$venv/bin/python" -m mstar_dist.runtime.torchrun --standalone --nproc-per-node "$nproc" --master-port "${MASTER_PORT:-29500}" \
  -m mstar_dist.serve "$config" "$@"
