#!/usr/bin/env bash
# Mixed soak on the H200 pair (issue 10): the SmolLM2 P/D deployment (launch/configs/smollm2_pd.yaml, 2 ranks) and
# the TP2 deployment (launch/configs/moe_tp2.yaml: SmolLM2's 9/3 heads do not split in two, so TP2 is the
# Qwen3-MoE-shaped family, tiny random weights written on first start) served at the same time on both GPUs, each
# driven by scripts/soak.py's mixed plan with client aborts (scripts/gpu_soak.py one), for SECONDS; then 0 live
# tensors, no crash, no NCCL watchdog timeout (rank logs, flight-recorder dumps), JSON verdict.
# A device command lasts at most 600 s, so the soak runs detached (setsid nohup) and outlives the command that
# started it; a later command collects it (the machine must stay warm in between: issue the next one at once).
#   bash scripts/gpu_soak.sh start [SECONDS=600]   launch into $SOAK_DIR (/tmp/soak), return at once
#   bash scripts/gpu_soak.sh collect [WAIT=540]    wait up to WAIT s for the end, copy the JSON + log tails to $OUT
#                                                  (or bench/raw); exit 0 passed, 1 failed, 3 still running
#   bash scripts/gpu_soak.sh auto [SECONDS] [WAIT] start unless a soak is in $SOAK_DIR already, then collect
#   bash scripts/gpu_soak.sh status | stop
# Env: SOAK_DIR, PYTHON (default python3, or .venv/bin/python where it exists), SOAK_CONCURRENCY_PD / _TP2
# (default 16 / 8 on CUDA, 2 / 2 on CPU), SOAK_BASELINE (the RSS baseline: after 2000 requests on CUDA, where the
# first thousands warm kernels and caches up: in the 2026-11-30 run RSS rose 16% by 3k requests and 5% after; 10 on
# CPU), MSTAR_TEST_WEIGHTS (default /tmp/smol-rand when it exists).
# On CPU (no 2 GPUs) the same flow runs with the CPU defaults and writes soak_mixed_cpu.json.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
dir="${SOAK_DIR:-/tmp/soak}"
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d /tmp/site ] && [[ ":$PYTHONPATH:" != *":/tmp/site:"* ]]; then
  export PYTHONPATH="/tmp/site:$PYTHONPATH" PATH="/tmp/site/bin:$PATH"
fi
if [ -z "${MSTAR_TEST_WEIGHTS:-}" ] && [ -f /tmp/smol-rand/config.json ]; then
  export MSTAR_TEST_WEIGHTS=/tmp/smol-rand
fi

running() { [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; }

tree() {  # a PID and all its descendants, children first
  local pid="$1" child
  for child in $(ps -o pid= --ppid "$pid" 2>/dev/null); do tree "$child"; done
  echo "$pid"
}

run() {  # the detached part: both deployments at once, then the verdict
  local seconds="$1" device conc_pd conc_tp2 over_pd over_tp2 rc_pd rc_tp2 limit baseline
  device="$("$py" -c "import torch; print('cuda' if torch.cuda.device_count() >= 2 else 'cpu')")"
  echo "$device" > "$dir/device"
  if [ "$device" = cuda ]; then
    conc_pd="${SOAK_CONCURRENCY_PD:-16}" conc_tp2="${SOAK_CONCURRENCY_TP2:-8}" baseline="${SOAK_BASELINE:-2000}"
    over_pd='{"model": "llama"}'  # plain HF Llama loader for the random checkpoint (as tests/gpu do)
  else
    conc_pd="${SOAK_CONCURRENCY_PD:-2}" conc_tp2="${SOAK_CONCURRENCY_TP2:-2}" over_pd='{}' baseline=10
  fi
  over_tp2='{"weights": "~/.cache/mstar_dist/qwen3-moe-tiny"}'
  limit=$((seconds + 420))  # start-up, the last requests, idle wait and stop fit in 7 minutes
  echo "$(date -Is) soak of ${seconds} s on $device: P/D concurrency $conc_pd, TP2 concurrency $conc_tp2"
  timeout -k 30 "$limit" "$py" scripts/gpu_soak.py one --name pd --config launch/configs/smollm2_pd.yaml \
    --override "$over_pd" --seconds "$seconds" --concurrency "$conc_pd" --baseline-after "$baseline" \
    --dir "$dir/pd" > "$dir/pd.out" 2>&1 &
  echo $! > "$dir/pd.pid"
  timeout -k 30 "$limit" "$py" scripts/gpu_soak.py one --name tp2 --config launch/configs/moe_tp2.yaml \
    --override "$over_tp2" --seconds "$seconds" --concurrency "$conc_tp2" --baseline-after "$baseline" \
    --dir "$dir/tp2" > "$dir/tp2.out" 2>&1 &
  echo $! > "$dir/tp2.pid"
  wait "$(cat "$dir/pd.pid")"; rc_pd=$?
  wait "$(cat "$dir/tp2.pid")"; rc_tp2=$?
  echo "$(date -Is) drivers exited: pd $rc_pd, tp2 $rc_tp2"
  "$py" scripts/gpu_soak.py combine --dir "$dir" --seconds "$seconds" --device "$device" --rcs "$rc_pd,$rc_tp2" \
    --out "$dir/result.json"
  echo $? > "$dir/done"
}

start() {
  local seconds="${1:-600}"
  if running; then echo "a soak is already running in $dir (pid $(cat "$dir/pid")): collect or stop it"; return 1; fi
  rm -rf "$dir"
  mkdir -p "$dir"
  setsid nohup bash "${BASH_SOURCE[0]}" _run "$seconds" > "$dir/runner.log" 2>&1 < /dev/null &
  echo $! > "$dir/pid"
  echo "soak of $seconds s started in $dir (runner pid $(cat "$dir/pid"))"
  echo "collect with: bash scripts/gpu_soak.sh collect"
}

collect() {
  local wait_s="${1:-540}" t0 out name device
  t0=$(date +%s)
  if [ ! -d "$dir" ]; then echo "no soak in $dir"; return 1; fi
  while [ ! -f "$dir/done" ] && running && [ $(( $(date +%s) - t0 )) -lt "$wait_s" ]; do
    sleep 15
    if [ $(( ($(date +%s) - t0) % 60 )) -lt 15 ]; then
      echo "$(date -Is) waiting: $(tail -n 1 "$dir/pd.out" 2>/dev/null) | $(tail -n 1 "$dir/tp2.out" 2>/dev/null)"
    fi
  done
  out="${OUT:-bench/raw}"
  mkdir -p "$out"
  device="$(cat "$dir/device" 2>/dev/null || echo cpu)"
  name=soak_mixed_cpu; [ "$device" = cuda ] && name=soak_h200x2
  {
    echo "== runner.log"; tail -n 40 "$dir/runner.log" 2>/dev/null
    for d in pd tp2; do
      echo "== $d.out"; tail -n 60 "$dir/$d.out" 2>/dev/null
      echo "== $d/server.log (last 80 lines)"; tail -n 80 "$dir/$d/server.log" 2>/dev/null
    done
  } > "$out/${name}_logs.txt"
  if [ -f "$dir/done" ]; then
    cp "$dir/result.json" "$out/$name.json" 2>/dev/null || echo "no $dir/result.json"
    echo "soak finished: $out/$name.json (verdict exit $(cat "$dir/done"))"
    "$py" -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({'passed': d['passed'], \
'criteria': d['criteria'], **{n: {'counts': p['counts'], 'traffic_s': p['traffic_s'], 'failed_checks': \
[k for k, v in p['checks'].items() if not v]} for n, p in d['deployments'].items()}}, indent=1))" "$out/$name.json"
    return "$(cat "$dir/done")"
  fi
  if running; then
    echo "still running after ${wait_s} s of waiting; partial logs in $out/${name}_logs.txt"
    return 3
  fi
  echo "the soak's runner is gone without a verdict; logs in $out/${name}_logs.txt"
  return 1
}

stop() {  # SIGTERM the drivers (each stops its server: SIGTERM to the ranks), then SIGKILL what is left
  local f pid pids=""
  for f in "$dir/pd.pid" "$dir/tp2.pid" "$dir/pd/server.pid" "$dir/tp2/server.pid" "$dir/pid"; do
    [ -f "$f" ] && pids="$pids $(tree "$(cat "$f")")"
  done
  for f in "$dir/pd.pid" "$dir/tp2.pid"; do [ -f "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null; done
  for _ in $(seq 60); do
    running || break
    sleep 1
  done
  for pid in $pids; do kill -KILL "$pid" 2>/dev/null; done
  echo "stopped"
}

case "${1:-}" in
  start) start "${2:-600}" ;;
  collect) collect "${2:-540}" ;;
  auto)
    if [ -f "$dir/done" ] || running; then collect "${3:-540}"; else start "${2:-600}" && collect "${3:-540}"; fi ;;
  status)
    if running; then echo "running (pid $(cat "$dir/pid"))"; tail -n 2 "$dir/pd.out" "$dir/tp2.out" 2>/dev/null
    elif [ -f "$dir/done" ]; then echo "done (verdict exit $(cat "$dir/done"))"
    else echo "no soak running in $dir"; fi ;;
  stop) stop ;;
  _run) run "$2" >> "$dir/runner.log" 2>&1 ;;
  *) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2 ;;
esac
