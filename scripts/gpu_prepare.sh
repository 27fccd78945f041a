#!/usr/bin/env bash
# Run on the dev machine (network to PyPI) before a device call: fills the two folders scripts/gpu_run.sh needs,
# both git-ignored locally (.git/info/exclude) and passed to the device tool's `carry`:
#   .whl/              wheels the GPU image lacks (Python 3.12, manylinux x86_64), one version each
#   .ckpt/smol-shape/  config + tokenizer of the prepared SmolLM2 dir (the weights are generated on the device)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.ckpt/' .git/info/exclude 2>/dev/null || echo '/.ckpt/' >> .git/info/exclude
venv="$(bash launch/install.sh | tail -n 1)"
py="$venv/bin/python"
mkdir -p .whl
for pkg in fastapi starlette pydantic pydantic_core annotated-types typing-inspection opentelemetry-api uvicorn \
           httptools pyzmq msgspec python-multipart llguidance soundfile cffi pycparser soxr; do
  version="$("$py" -c "import importlib.metadata as m; print(m.version('$pkg'))")"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "$pkg==$version"
done
rm -rf .whl/extra .whl/uvloop-* .whl/py_spy-* .whl/mooncake*  # what an older .whl may hold that no step needs
weights="${MSTAR_WEIGHTS:-$HOME/.cache/mstar_dist/smollm2-135m-instruct}"
"$py" -c "from mstar_dist.tools.gguf_import import ensure_smollm2_weights as e; e('$weights')"
mkdir -p .ckpt/smol-shape
cp "$weights"/{config.json,tokenizer.json,tokenizer_config.json,generation_config.json} .ckpt/smol-shape/
du -sh .whl .ckpt
