#!/usr/bin/env bash
# One host of a multi-host deployment:
#   NODE_RANK=k MASTER_ADDR=<node 0's address> bash launch/serve_node.sh CONFIG [serve flags...]
# CONFIG must have a cluster: section; host k of it runs here with one process per device it lists.
# First every host checks in (python -m mstar_dist.distributed.join): a host that never joins is named, by name and
# node rank, and this exits non-zero within STARTUP_TIMEOUT plus a few seconds (torchrun alone would wait in
# its rendezvous without saying for whom). Then torchrun with static rendezvous on MASTER_ADDR:MASTER_PORT.
# Env: NODE_RANK, MASTER_ADDR (required); MASTER_PORT (default 29500; the join check uses MASTER_PORT+1);
#      STARTUP_TIMEOUT (default 300 s: the join check, and every rank's --startup-timeout);
#      PYTHON (default <repo>/.venv/bin/python when present, else python3);
#      MSTAR_REJOIN=1: this host comes back into a deployment that still serves (rank 0's host never left): no join
#      check (the other hosts passed it long ago); its ranks rejoin the running deployment (docs/architecture.md §10).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="$1"
shift
: "${NODE_RANK:?set NODE_RANK to this host's index in the cluster spec}"
: "${MASTER_ADDR:?set MASTER_ADDR to node 0's address}"
port="${MASTER_PORT:-29500}"
timeout="${STARTUP_TIMEOUT:-300}"
py="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$py" ] || py=python3
read -r nnodes nproc < <("$py" - "$config" "$NODE_RANK" <<'PY'
import sys, yaml
hosts = (yaml.safe_load(open(sys.argv[1])).get("cluster") or {}).get("hosts")
if not hosts:
    sys.exit(f"{sys.argv[1]}: serve_node.sh needs a cluster: section listing every host")
k = int(sys.argv[2])
if not 0 <= k < len(hosts):
    sys.exit(f"NODE_RANK={k} but {sys.argv[1]} lists {len(hosts)} hosts")
devices = hosts[k]["devices"]
print(len(hosts), devices if isinstance(devices, int) else len(devices))
PY
)
cd "$repo"
if [ -z "${MSTAR_REJOIN:-}" ]; then
  "$py" -m mstar_dist.distributed.join "$config" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" \
    --port "$((port + 1))" --timeout "$timeout"
fi
exec "$py" -m mstar_dist.runtime.torchrun --nnodes "$nnodes" --node-rank "$NODE_RANK" --nproc-per-node "$nproc" \
  --master-addr "$MASTER_ADDR" --master-port "$port" \
  -m mstar_dist.serve "$config" --startup-timeout "$timeout" "$@"
