#!/usr/bin/env bash
# A real two-node SLURM cluster on this machine, for tests/slurm/test_slurm.py (docs/architecture.md §11):
#   bash tests/slurm/setup_cluster.sh up DIR     # install (apt) if needed, start munged, slurmctld, two slurmd
#   bash tests/slurm/setup_cluster.sh down DIR   # cancel jobs, stop the daemons it started (by pid), remove DIR
# Nodes: this machine's hostname and `localhost` (both resolve), each its own `slurmd -N NAME` on its own port;
# batch_sched_delay=0 so a job starts about a second after sbatch. Everything lives in DIR (SLURM_CONF=DIR/slurm.conf);
# nothing outside it is touched except the packages and munge's key and runtime directory.
# Exit codes: 0 ok; 3 SLURM cannot be installed here (no apt-get, or it failed): the test skips, printing why.
set -euo pipefail
cmd="${1:?usage: setup_cluster.sh up|down DIR}"
dir="${2:?usage: setup_cluster.sh up|down DIR}"

stop_pids() {
  for f in "$dir"/*.pid; do
    [ -e "$f" ] || continue
    pid="$(cat "$f")"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
  done
}

if [ "$cmd" = down ]; then
  if [ -f "$dir/slurm.conf" ]; then
    export SLURM_CONF="$dir/slurm.conf"
    scancel --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 150); do  # let the jobs end before their node daemons go
      [ -z "$(squeue -h 2>/dev/null)" ] && break
      sleep 0.2
    done
  fi
  # job step daemons are children of our slurmd: gather them (and theirs) before stopping it
  steps=()
  for f in "$dir"/slurmd-*.pid; do
    [ -e "$f" ] || continue
    todo=("$(cat "$f")")
    while [ ${#todo[@]} -gt 0 ]; do
      kids=($(pgrep -P "${todo[0]}" || true))
      todo=("${todo[@]:1}" "${kids[@]}")
      steps+=("${kids[@]}")
    done
  done
  stop_pids
  for pid in "${steps[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  rm -rf "$dir"
  exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  if ! command -v apt-get >/dev/null; then
    echo "setup_cluster: slurm-wlm and munge are not installed and apt-get is not available" >&2
    exit 3
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq slurm-wlm munge; } >"${TMPDIR:-/tmp}/mstar-slurm-apt.log" 2>&1; then
    echo "setup_cluster: apt-get install slurm-wlm munge failed: $(tail -n 3 "${TMPDIR:-/tmp}/mstar-slurm-apt.log")" >&2
    exit 3
  fi
fi

mkdir -p "$dir/state" "$dir/spool" "$dir/log"
host="$(hostname)"
user="$(id -un)"
cpus="$(nproc)"
ports=($(python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
))

# munge: one daemon per machine; reuse a running one (it may serve others), else start ours
if ! munge -n >/dev/null 2>&1 </dev/null; then
  mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
  chmod 0400 /etc/munge/munge.key
  if id munge >/dev/null 2>&1; then chown -R munge: /etc/munge /run/munge /var/lib/munge /var/log/munge; fi
  munged --force --pid-file="$dir/munged.pid" 2>/dev/null || munged --force
  [ -s "$dir/munged.pid" ] || pgrep -n -x munged >"$dir/munged.pid" || true
  for _ in $(seq 50); do munge -n >/dev/null 2>&1 </dev/null && break; sleep 0.1; done
fi

cat >"$dir/slurm.conf" <<EOF
ClusterName=mstar-test
SlurmctldHost=$host
SlurmctldPort=${ports[0]}
SlurmUser=$user
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0
SelectType=select/linear
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=10
InactiveLimit=0
MinJobAge=60
NodeName=$host NodeHostname=$host Port=${ports[1]} CPUs=$cpus State=UNKNOWN
NodeName=localhost NodeHostname=$host NodeAddr=127.0.0.1 Port=${ports[2]} CPUs=$cpus State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
export SLURM_CONF="$dir/slurm.conf"
mkdir -p "$dir/spool/$host" "$dir/spool/localhost"
slurmctld -D -i -f "$SLURM_CONF" >"$dir/log/slurmctld.out" 2>&1 &
echo $! >"$dir/slurmctld.pid.own"
for name in "$host" localhost; do
  slurmd -D -N "$name" -f "$SLURM_CONF" >"$dir/log/slurmd-$name.out" 2>&1 &
  echo $! >"$dir/slurmd-$name.pid.own"
done
for f in "$dir"/*.pid.own; do mv "$f" "${f%.own}"; done

for _ in $(seq 150); do
  if [ "$(sinfo -h -N -t idle -o '%N' 2>/dev/null | wc -l)" = 2 ]; then
    sinfo
    exit 0
  fi
  sleep 0.2
done
echo "setup_cluster: the two nodes did not come up idle within 30 s:" >&2
sinfo >&2 || true
tail -n 20 "$dir/log/slurmctld.log" "$dir"/log/slurmd-*.log >&2 || true
exit 1
