#!/usr/bin/env bash
# GPU runs on the device machine (torch + NCCL preinstalled, no network). Usage, from the repo root there:
#   bash scripts/gpu_run.sh STEP...   STEP: tests | gpu | engine | tpstop | serving | chat | pd | split | edges |
#                                           kernels | trace | composite | speech | speech1 | speechprof |
#                                           image | imagefull | tp | moe30b | soak | ab SETTING
# Needs, carried from the dev machine (bash scripts/gpu_prepare.sh makes both): .whl/ (wheels the GPU image lacks:
# fastapi, starlette, pydantic(-core), annotated-types, typing-inspection, opentelemetry-api, uvicorn, httptools,
# pyzmq, msgspec, python-multipart, llguidance, soundfile, cffi, pycparser, soxr) and .ckpt/smol-shape (config + tokenizer of SmolLM2-135M; a random same-shaped checkpoint is
# generated there). Everything a step writes goes to $OUT (or bench/raw, git-ignored); the headline JSONs are copied
# from there into bench/results by hand (bench/results/README.md names the step behind each).
# Knobs of the steps (environment): ROUNDS, INTAKES (HTTP intake processes of the single rank, default 4), STREAMS,
# PAIRS, REQUESTS_PER_STREAM, NAME (a suffix for the output names), DECODE / PREFILL / POSITION (kernels), TOKENS
# (moe30b's timed decode steps).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "${OUT:-bench/raw}"
out="$(cd "${OUT:-bench/raw}" && pwd)"  # absolute: the tree A/B runs the other tree from its own folder
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH="/tmp/site:$PWD" MSTAR_TEST_WEIGHTS=/tmp/smol-rand PATH="/tmp/site/bin:$PATH"
[ -f /tmp/smol-rand/model.safetensors ] || python3 scripts/make_random_checkpoint.py --like .ckpt/smol-shape \
  --out /tmp/smol-rand --dtype bfloat16 >/dev/null 2>&1 || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# the host's CPUs: the rank, the front end, the intakes and the benchmark's clients share them
lscpu 2>/dev/null | grep -E "^(CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|Model name):" | tr -s " "
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
intakes_config() {  # /tmp/smollm2_single_intakes.yaml: the single rank with $1 HTTP intake processes
  sed "s/server: {host: 127.0.0.1, port: 8000}/server: {host: 127.0.0.1, port: 8000, http_processes: $1}/" \
    launch/configs/smollm2_single.yaml > /tmp/smollm2_single_intakes.yaml
}
merged_config() {  # $3: the deployment $1 with the YAML mapping $2 merged into it (nested mappings key by key)
  python3 - "$1" "$2" "$3" <<'PY'
import sys

import yaml


def merge(base, extra):
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value
    return base


base, extra, path = sys.argv[1], yaml.safe_load(sys.argv[2]), sys.argv[3]
if not isinstance(extra, dict):
    sys.exit(f"gpu_run.sh ab: the setting must be a YAML mapping, got {sys.argv[2]!r}")
with open(base) as f:
    config = yaml.safe_load(f)
with open(path, "w") as f:
    yaml.safe_dump(merge(config, extra), f, sort_keys=False)
PY
}
ab_bench() {  # $1: the tree to run in, $2: config, $3: output JSON, then extra bench_serving flags
  local tree="$1" cfg="$2" json="$3"
  shift 3
  (cd "$tree" && PYTHONPATH="/tmp/site:$PWD" timeout 150 python3 scripts/bench_serving.py --device cuda --model llama \
    --rounds 1 --max-tokens 256 --no-hf --no-eager-bare --streams ${STREAMS:-1 32 64} \
    --requests-per-stream "${REQUESTS_PER_STREAM:-4}" --config "$cfg:1" --out "$json" "$@" 2>&1 \
    | grep -A4 '"median_tok_s"\|"ttft_median_s"')
}
ab() {  # the generic A/B (see the `ab` step below); $1: SETTING
  local setting="$1" base_cfg=/tmp/smollm2_single_intakes.yaml name="${NAME:-ab}" i
  intakes_config "${INTAKES:-4}"
  local a_tree=. b_tree=. a_cfg="$base_cfg" b_cfg="$base_cfg" a_flags=()
  case "$setting" in
    tree) if [ ! -d .ab_base/scripts ]; then
            echo "ab tree: no .ab_base/scripts (carry a git archive of the base tree)"
            return 2
          fi
          b_tree="$PWD/.ab_base" ;;
    --*)  read -r -a a_flags <<< "$setting" ;;
    *)    a_cfg=/tmp/ab_setting.yaml
          merged_config "$base_cfg" "$setting" "$a_cfg" || return 2
          cat "$a_cfg" ;;
  esac
  for i in $(seq "${PAIRS:-2}"); do  # B first, as every A/B of the results' decision log ran
    ab_bench "$b_tree" "$b_cfg" "$out/ab_${name}_b_$i.json"
    ab_bench "$a_tree" "$a_cfg" "$out/ab_${name}_a_$i.json" ${a_flags[@]+"${a_flags[@]}"}
  done
}
while [ $# -gt 0 ]; do
  step="$1"
  shift
  echo "== $step"
  case "$step" in
    tests)   python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit tests/dist --ignore=tests/unit/test_client.py \
               --ignore=tests/unit/test_llama_parity.py 2>&1 | tee "$out/gpu_tests.log" | tail -15 ;;
    gpu)     # the CUDA tests alone: serving on one GPU, P/D over NCCL, speech and image split over the pair
             timeout 500 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu_tests_gpu.log" | tail -15 ;;
    engine)  # the engine's CUDA tests: decode and prefill graphs, lookahead, the Triton kernels
             python3 -c "import triton; print('triton', triton.__version__)" || echo "triton: not importable"
             timeout 300 python3 -m pytest -q -p no:cacheprovider tests/unit/test_kv_engine.py \
               tests/unit/test_graph_decode.py tests/unit/test_decode_attention.py tests/unit/test_fused.py 2>&1 | tail -6 ;;
    tpstop)  # TP over NCCL through the launcher, stopped with SIGTERM under load (docs/architecture.md §4b)
             timeout 400 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_tensor_parallel.py \
               -k "tp2_gives or losing" 2>&1 | tee "$out/gpu_tpstop.log" | tail -15 ;;
    serving) # the headline: the single rank with ${INTAKES:-4} intakes at 1, 8, 32 and 64 streams, 256 tokens,
             # ${ROUNDS:-3} rounds, against the CUDA-graph bare loop's decode steps (and HF generate where
             # transformers imports)
             intakes_config "${INTAKES:-4}"
             hf=$(python3 -c "import transformers" 2>/dev/null || echo --no-hf)
             timeout 500 python3 scripts/bench_serving.py --device cuda --model llama --rounds "${ROUNDS:-3}" --max-tokens 256 \
               --no-eager-bare $hf --streams 1 8 32 64 --config /tmp/smollm2_single_intakes.yaml:1 \
               --out "$out/serving_h200_single.json" 2>&1 | grep -A20 '"median_tok_s"' | head -60 ;;
    chat)    # both streaming routes on the single rank with ${INTAKES:-4} intakes, side by side at 1, 8, 32 and 64
             # streams: /generate and /v1/chat/completions (ignore_eos: 256 tokens each), 256 tokens, ${ROUNDS:-3}
             # rounds, ${REQUESTS_PER_STREAM:-8} requests per stream, against the CUDA-graph bare loop's decode steps
             intakes_config "${INTAKES:-4}"
             timeout 540 python3 scripts/bench_serving.py --device cuda --model llama --rounds "${ROUNDS:-3}" \
               --max-tokens 256 --no-hf --no-eager-bare --route generate chat --streams 1 8 32 64 \
               --requests-per-stream "$(( ${REQUESTS_PER_STREAM:-8} < 8 ? 8 : ${REQUESTS_PER_STREAM:-8} ))" \
               --config /tmp/smollm2_single_intakes.yaml:1 --out "$out/serving_h200_routes${NAME:+_$NAME}.json" 2>&1 \
               | grep -A30 '"median_tok_s"' | head -80 ;;
    pd)      # two GPUs: the single rank and P/D (prefill on GPU 0, decode on GPU 1) side by side, 1 to 64 streams
             timeout 300 python3 scripts/bench_serving.py --device cuda --model llama --rounds "${ROUNDS:-1}" \
               --max-tokens 256 --no-hf --no-eager-bare --streams 1 8 32 64 --config launch/configs/smollm2_single.yaml:1 \
               --config launch/configs/smollm2_pd.yaml:2 --out "$out/serving_h200x2_pd.json" 2>&1 | tail -60 ;;
    split)   # two GPUs: P/D against the single rank at 1 stream, end-to-end p50 of the same requests (split overhead)
             timeout 300 python3 scripts/bench_serving.py --device cuda --model llama --rounds 3 --max-tokens 256 --no-hf \
               --no-eager-bare --streams 1 --config launch/configs/smollm2_pd.yaml:2 \
               --config launch/configs/smollm2_single.yaml:1 --out "$out/serving_h200x2_split.json" 2>&1 | tail -40 ;;
    edges)   # two GPUs: ping-pong one-way times and windowed bandwidth of our edge against raw NCCL send/recv
             # (receivers spin as GPU ranks do; SPIN_US=0 measures them sleeping)
             timeout 240 torchrun --standalone --nproc-per-node 2 scripts/bench_edges.py --device cuda \
               ${SPIN_US:+--spin-us $SPIN_US} --out "$out/edges_h200x2${SPIN_US:+_spin$SPIN_US}.json" 2>&1 | tail -20 ;;
    kernels) # GPU time and kernel counts of one captured decode step (rows ${DECODE:-1 32 64} at ${POSITION:-300})
             # and of batched prefills (${PREFILL:-1x48 16x48 32x48}: prompts x tokens); COMPILE=1 adds a
             # torch.compile'd graph of each (slow: about a minute a shape)
             timeout 480 python3 scripts/bench_kernels.py --weights /tmp/smol-rand \
               $([ -n "${COMPILE:-}" ] || echo --no-compile) --decode ${DECODE:-1 32 64} \
               --prefill ${PREFILL:-1x48 16x48 32x48} --position "${POSITION:-300}" \
               --out "$out/kernels_h200${NAME:+_$NAME}.json" 2>&1 | grep -v "^W1\|^  warnings" | tail -30 ;;
    trace)   # where TTFT goes: the phase trace (MSTAR_DIST_TRACE_DIR) of the single rank with ${INTAKES:-4} intakes at
             # 1 and 32 streams (REQUESTS_PER_STREAM=K: K requests per client stream); every event in the .events.jsonl
             intakes_config "${INTAKES:-4}"
             timeout 150 python3 scripts/ttft_trace.py --device cuda --model llama --max-tokens 256 --streams 1 32 \
               ${REQUESTS_PER_STREAM:+--requests-per-stream $REQUESTS_PER_STREAM} \
               --config /tmp/smollm2_single_intakes.yaml:1 --out "$out/ttft_trace_h200${NAME:+_$NAME}.json" \
               --events-out "$out/ttft_trace_h200${NAME:+_$NAME}.events.jsonl" 2>&1 \
               | grep -v "^W1\|^  \|Traceback\|^torch\|File " | tail -45 ;;
    composite) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_composite_cuda.py 2>&1 | tail -15 ;;
    speech)  # two GPUs: time to first audio and real-time factor, codec beside the LLM or on the other GPU
             python3 scripts/bench_composite.py speech --make 3b --weights /tmp/orpheus-3b --streams 1 8 32 \
               --max-tokens 560 --out "$out/speech_h200x2.json" 2>&1 | tail -30 ;;
    speech1) # one GPU, the codec beside the LLM (Orpheus-3B shape): TTFA p50/p99, RTF p50/p99 and the real-time
             # streams at ${STREAMS:-1 8 32 64 128 256} concurrent streams, one wave each, 560 codes a stream (280 at
             # 128 and 256: the JSON's tokens_at); waves that would start after 220 s are skipped (the JSON's
             # skipped), and the JSON is rewritten after each wave (a run stopped by the time limit keeps them)
             timeout -k 15 280 python3 scripts/bench_composite.py speech --make 3b --weights /tmp/orpheus-3b \
               --placement colocated --streams ${STREAMS:-1 8 32 64 128 256} --max-tokens 560 \
               --tokens-at 128:280 256:280 --intakes "${INTAKES:-4}" --budget-s 220 \
               --out "$out/speech_h200_colocated${NAME:+_$NAME}.json" 2>&1 | grep -v "^W1\|^  warnings" | tail -30 ;;
    speechprof) # one GPU, in process (Orpheus-3B shape): the LLM engine's decode step with Orpheus's sampling, top-p
             # alone and greedy, the codec's batched windows, the real-time bound they leave at ${STREAMS:-8 32 64 128 256}
             # streams, and which batch or memory conditions change a stream's bits
             timeout -k 15 240 python3 scripts/profile_speech.py --make 3b --weights /tmp/orpheus-3b \
               --streams ${STREAMS:-8 32 64 128 256} --out "$out/speech_profile_h200${NAME:+_$NAME}.json" 2>&1 \
               | grep -v "^W1\|^  warnings" | tail -30 ;;
    image)   # two GPUs: time per denoising step, sequential CFG on one GPU against CFG-parallel on two
             python3 scripts/bench_composite.py image --make tiny --weights /tmp/qwen-image-tiny --size 1024 --steps 8 24 \
               --out "$out/image_h200x2.json" 2>&1 | tail -30 ;;
    imagefull) # two GPUs: the published denoiser's size (20.4B, random bf16, ~41 GB written first), 1024x1024, 28 and 50
             # steps: whole requests, sequential CFG on one GPU against CFG-parallel on two, one round
             timeout -k 15 560 python3 scripts/bench_composite.py image --make full --weights /tmp/qwen-image-full \
               --size 1024 --steps 28 50 --rounds "${ROUNDS:-1}" --out "$out/image_full_h200x2.json" 2>&1 | tail -30 ;;
    tp)      # two GPUs: TP2 against TP1 of a Qwen3-MoE-shaped checkpoint (NCCL check, then serving at 1 and 32 streams)
             timeout 540 python3 scripts/bench_tp.py --make medium --weights /tmp/moe-medium --streams 1 32 \
               --max-tokens 128 --out "$out/tp_h200x2.json" 2>&1 | tail -30 ;;
    moe30b)  # one GPU: Qwen3-MoE at the 30B-A3B shape, TP1, random bf16 weights made on the GPU (~61 GB, no
             # checkpoint): the engine's decode steps (in process) against the CUDA-graph bare loop and the eager
             # loop at ${STREAMS:-1 32 64} streams, and one MoE block's gathered vs per-expert expert compute
             timeout -k 15 280 python3 scripts/bench_moe30b.py --streams ${STREAMS:-1 32 64} --tokens "${TOKENS:-64}" \
               --out "$out/moe30b_h200${NAME:+_$NAME}.json" 2>&1 | grep -v "^W1\|^  warnings" | tail -40 ;;
    soak)    # two GPUs, detached: starts a ${SOAK_SECONDS:-600} s soak unless one is in /tmp/soak, waits up to
             # SOAK_WAIT s; collect the rest at once in the next command: bash scripts/gpu_soak.sh collect 540
             bash scripts/gpu_soak.sh auto "${SOAK_SECONDS:-600}" "${SOAK_WAIT:-480}" 2>&1 | tail -60 ;;
    ab)      # one A/B: the single rank with ${INTAKES:-4} intakes, ${STREAMS:-1 32 64} streams, 256 greedy tokens,
             # ${REQUESTS_PER_STREAM:-4} requests per client stream, side B then side A, one round each, ${PAIRS:-2}
             # alternated pairs, into ab_${NAME:-ab}_{b,a}_N.json. The next argument is the SETTING of side A:
             #   tree              A: this tree, B: the tree in .ab_base (carried; e.g.
             #                     mkdir .ab_base && git archive HEAD~1 | tar -x -C .ab_base)
             #   '{YAML mapping}'  A: the deployment with the mapping merged in, e.g. '{server: {http_processes: 8}}' or
             #                     '{engine: {decode_yield_ms: 16}}'; B: the deployment as it is
             #   '--FLAG ...'      A: bench_serving with these flags, e.g. '--client-cpus 8-15'; B: without them
             [ $# -gt 0 ] || { echo "ab: needs a SETTING (tree, a YAML mapping, or bench_serving flags)"; exit 2; }
             setting="$1"
             shift
             ab "$setting" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
