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
           httptools pyzmq msgspec; do
  version="$("$py" -c "import importlib.metadata as m; print(m.version('$pkg'))")"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "$pkg==$version"
done
rm -rf .whl/extra .whl/uvloop-*  # httptools, once apart for an A/B, is a dependency now
# py-spy (scripts/profile_serving.py, gpu_run.sh profile): not in the venv, any recent release
"$py" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.12 \
  -d .whl py-spy
# Mooncake transfer engine, CPU build (gpu_run.sh twohost: the inter-host edge on Mooncake tcp; our transport
# stages CUDA tensors through its registered host pool). Its requirements (aiohttp, msgpack, requests) are on the
# GPU image. The wheel is 46 MB, too much to carry beside the rest (64 MiB a call): it is carried slimmed to what
# `import mooncake.engine` loads (~13 MB; the store, master, client and bench binaries and their libraries left
# out), with mooncake_syslibs.tar.gz beside it: the system libraries engine.so links (libibverbs, libnuma, libcurl
# and what they link) as this machine has them; scripts/gpu_two_host.py links from it only those the image lacks.
mc_version="$("$py" -c "import importlib.metadata as m; print(m.version('mooncake-transfer-engine-non-cuda'))" \
  2>/dev/null || echo 0.3.13.post1)"
mc_tmp="$(mktemp -d)"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$mc_tmp" "mooncake-transfer-engine-non-cuda==$mc_version"
rm -f .whl/mooncake_transfer_engine*.whl .whl/mooncake_syslibs.tar.gz
"$py" - "$mc_tmp" .whl <<'EOF'
import re, subprocess, sys, tarfile, zipfile
from pathlib import Path

tmp, dest = Path(sys.argv[1]), Path(sys.argv[2])
src = next(tmp.glob("mooncake_transfer_engine_non_cuda-*.whl"))
libs = "mooncake_transfer_engine_non_cuda.libs/"
drop = {"mooncake/transfer_engine_bench", "mooncake/store.so", "mooncake/mooncake_master", "mooncake/mooncake_client",
        libs + "libetcd_wrapper-0b032a94.so", libs + "libasio-d08c9e24.so", libs + "libzstd-abac8a45.so.1.5.5",
        libs + "libxxhash-3b878866.so.0.8.2", libs + "liburing-2907b6bc.so.1.0.7"}
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest / src.name, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if info.filename in drop:
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True)
                            if line.split(b",", 1)[0].decode() not in drop)
        out = zipfile.ZipInfo(info.filename, info.date_time)  # a copy: writestr sets the offsets of what it gets
        out.external_attr, out.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
        zout.writestr(out, data)
with zipfile.ZipFile(dest / src.name) as slim:
    slim.extractall(tmp / "x")
# the system libraries engine.so links (glibc, libstdc++ and libgcc_s are on every image), as files named by soname
ldd = subprocess.run(["ldd", str(tmp / "x/mooncake/engine.so")], capture_output=True, text=True, check=True).stdout
base = re.compile(r"^(libc|libm|libpthread|libdl|librt|libresolv|libutil|libnsl|libanl|ld-linux.*|libstdc\+\+|"
                  r"libgcc_s)\.so")
with tarfile.open(dest / "mooncake_syslibs.tar.gz", "w:gz") as tar:
    for name, path in re.findall(r"^\s*(\S+) => (/\S+)", ldd, re.M):
        if not base.match(name) and str(tmp / "x") not in path:
            tar.add(str(Path(path).resolve()), arcname=name)
print(f"{dest / src.name}: {(dest / src.name).stat().st_size / 1e6:.1f} MB, system libraries: "
      f"{(dest / 'mooncake_syslibs.tar.gz').stat().st_size / 1e6:.1f} MB")
EOF
rm -rf "$mc_tmp"
weights="${MSTAR_WEIGHTS:-$HOME/.cache/mstar_dist/smollm2-135m-instruct}"
"$py" -c "from mstar_dist.tools.gguf_import import ensure_smollm2_weights as e; e('$weights')"
mkdir -p .ckpt/smol-shape
cp "$weights"/{config.json,tokenizer.json,tokenizer_config.json,generation_config.json} .ckpt/smol-shape/
du -sh .whl .ckpt
