#!/usr/bin/env bash
# GPU runs on the device machine (torch + NCCL preinstalled, no network). Usage, from the repo root there:
#   bash scripts/gpu_run.sh STEP...      STEP: tests | gpu | tpstop | serving | pd | pace | pace2 | ttft | ttftrace | profile | edges | split |
#                                        composite | speech | image | twohost | soak | h11 | parserab | intakes48 |
#                                        prefillab | engine | ttftab | treeab | intakeab |
#                                        overlap | streamab | clientab | intaketrace | prefillbench |
#                                        knobab | gatherab | firstuse | kernels | attn | attnab | pinab
# Needs, carried from the dev machine (bash scripts/gpu_prepare.sh makes both): .whl/ (wheels the GPU image lacks: fastapi, starlette, pydantic(-core),
# annotated-types, typing-inspection, opentelemetry-api, uvicorn, httptools, pyzmq, msgspec, py-spy) and .ckpt/smol-shape (config +
# tokenizer of SmolLM2-135M; a random same-shaped checkpoint is generated there). Results go to $OUT (or bench/results).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out="${OUT:-bench/results}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
h11_site() {  # /tmp/site_h11: /tmp/site without httptools (uvicorn then parses with h11, as before the fourteenth session)
  rm -rf /tmp/site_h11 && cp -a /tmp/site /tmp/site_h11 && rm -rf /tmp/site_h11/httptools*
}
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
tag=""  # appended to the result names of ttft, ttftrace and profile once the h11 step has run
for step in "$@"; do
  echo "== $step"
  case "$step" in
    tests)   python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit tests/dist --ignore=tests/unit/test_client.py \
               --ignore=tests/unit/test_llama_parity.py 2>&1 | tee "$out/gpu_tests.log" | tail -15 ;;
    gpu)     # the CUDA tests alone: serving on one GPU, P/D over NCCL, speech and image split over the pair
             timeout 500 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu_tests_gpu.log" | tail -15 ;;
    tpstop)  # TP over NCCL through the launcher, stopped with SIGTERM under load (docs/architecture.md §4b)
             timeout 400 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_tensor_parallel.py \
               -k "tp2_gives or losing" 2>&1 | tee "$out/gpu_tpstop.log" | tail -15 ;;
    serving) # the measurement: the single rank with ${INTAKES:-4} intakes at 1, 8, 32 and 64 streams, 256 tokens,
             # ${ROUNDS:-3} rounds, against the CUDA-graph bare loop (and HF generate where transformers imports)
             intakes_config "${INTAKES:-4}"
             hf=$(python3 -c "import transformers" 2>/dev/null || echo --no-hf)
             timeout 500 python3 scripts/bench_serving.py --device cuda --model llama --rounds "${ROUNDS:-3}" --max-tokens 256 \
               --no-eager-bare $hf --streams 1 8 32 64 --config /tmp/smollm2_single_intakes.yaml:1 \
               --out "$out/serving_h200_single$tag.json" 2>&1 | grep -A20 '"median_tok_s"' | head -60 ;;
    pd)      python3 scripts/bench_serving.py --device cuda --model llama --rounds 3 \
               --config launch/configs/smollm2_pd.yaml:2 --out "$out/serving_h200x2_pd.json" 2>&1 | tail -30 ;;
    pace)    # the single-rank deployment with decode lookahead off, for its share of the gain
             { cat launch/configs/smollm2_single.yaml; echo "model_kwargs: {lookahead: false}"; } \
               > /tmp/smollm2_single_nolookahead.yaml
             timeout 280 python3 scripts/bench_serving.py --device cuda --model llama --rounds 1 --max-tokens 256 --no-hf \
               --streams 1 8 32 64 --config launch/configs/smollm2_single.yaml:1 \
               --config launch/configs/smollm2_pd.yaml:2 --config /tmp/smollm2_single_nolookahead.yaml:1 \
               --out "$out/serving_h200x2_pace.json" 2>&1 | tail -60 ;;
    pace2)   # single rank and P/D only (no lookahead-off row), 1 round, plus the engine's lookahead test on CUDA
             timeout 300 python3 scripts/bench_serving.py --device cuda --model llama --rounds 1 --max-tokens 256 --no-hf \
               --no-eager-bare --streams 1 8 32 64 --config launch/configs/smollm2_single.yaml:1 \
               --config launch/configs/smollm2_pd.yaml:2 --out "$out/serving_h200x2_pace.json" 2>&1 | tail -60
             timeout 100 python3 -m pytest -q -p no:cacheprovider tests/unit/test_kv_engine.py 2>&1 | tail -4 ;;
    prefillab) # the single rank with prefill graphs (the default) against without, side by side: TTFT and tok/s
             { cat launch/configs/smollm2_single.yaml; echo "model_kwargs: {prefill_graphs: false}"; } \
               > /tmp/smollm2_single_eager_prefill.yaml
             timeout 420 python3 scripts/bench_serving.py --device cuda --model llama --rounds 1 --max-tokens 256 --no-hf \
               --no-eager-bare --streams 1 8 32 64 --config launch/configs/smollm2_single.yaml:1 \
               --config /tmp/smollm2_single_eager_prefill.yaml:1 --out "$out/serving_h200_prefill_graphs$tag.json" 2>&1 \
               | tail -40 ;;
    intakeab) # the single rank with the front end's own HTTP thread against ${INTAKES:-4} intake processes
             # (server.http_processes), side by side: tok/s and TTFT at 1, 8, 32 and 64 streams; then the phase trace
             # of the intake deployment at 1 and 32 streams
             intakes_config "${INTAKES:-4}"
             # (ROUNDS, default 1, and STREAMS, default "1 8 32 64", change the bench; TRACE=0 skips the trace)
             timeout 400 python3 scripts/bench_serving.py --device cuda --model llama --rounds "${ROUNDS:-1}" \
               --max-tokens 256 --no-hf --no-eager-bare --streams ${STREAMS:-1 8 32 64} \
               --config launch/configs/smollm2_single.yaml:1 --config /tmp/smollm2_single_intakes.yaml:1 \
               --out "$out/serving_h200_intakes${INTAKES:+_$INTAKES}${ROUNDS:+_r$ROUNDS}$tag.json" 2>&1 | tail -40
             [ "${TRACE:-1}" = 0 ] || timeout 150 python3 scripts/ttft_trace.py --device cuda --model llama --max-tokens 256 --streams 1 32 \
               --config /tmp/smollm2_single_intakes.yaml:1 --out "$out/ttft_trace_h200_intakes${INTAKES:+_$INTAKES}$tag.json" 2>&1 \
               | grep -v "^W1\|^  \|Traceback\|^torch\|File " | tail -45 ;;
    ttftab)  # TTFT at 1 and 32 streams of the single rank, 3 rounds, with 8 client streams per client process and
             # with ${SPP:-2} (a client process's threads share its GIL)
             for spp in 8 ${SPP:-2}; do
               timeout 170 python3 scripts/bench_serving.py --device cuda --model llama --rounds 3 --max-tokens 256 \
                 --no-hf --no-eager-bare --streams 1 32 --streams-per-process "$spp" \
                 --config launch/configs/smollm2_single.yaml:1 --out "$out/serving_h200_ttft_spp$spp$tag.json" 2>&1 \
                 | grep -A3 '"ttft_median_s"\|ttft_32_over'
             done ;;
    treeab)  # this tree against the one in .ab_base (carried; e.g. `git archive HEAD~1 mstar_dist models scripts tests
             # launch`), alternating, one round each, ${PAIRS:-2} pairs: tok/s and TTFT of the single rank at
             # ${STREAMS:-1 32 64} streams; with TREE_INTAKES=N both serve through N HTTP intake processes; with
             # REQUESTS_PER_STREAM=K, K requests per client stream (both trees' bench_serving must take the flag)
             cfg=$PWD/launch/configs/smollm2_single.yaml
             if [ -n "${TREE_INTAKES:-}" ]; then
               cfg=/tmp/smollm2_single_intakes.yaml
               intakes_config "$TREE_INTAKES"
             fi
             for i in $(seq "${PAIRS:-2}"); do
               for tree in .ab_base .; do
                 name=$([ "$tree" = . ] && echo new || echo base)
                 (cd "$tree" && PYTHONPATH="/tmp/site:$PWD" timeout 150 python3 scripts/bench_serving.py --device cuda \
                   --model llama --rounds 1 --max-tokens 256 --no-hf --no-eager-bare --streams ${STREAMS:-1 32 64} \
                   ${REQUESTS_PER_STREAM:+--requests-per-stream $REQUESTS_PER_STREAM} \
                   --config "$cfg:1" --out "$out/serving_h200_treeab${TREE_INTAKES:+_intakes}_${name}_$i.json" 2>&1 \
                   | grep -A4 '"median_tok_s"\|"ttft_median_s"')
               done
             done ;;
    prefillbench) # a batched prefill replayed from the prefill graphs, alone: this tree against the one in .ab_base
             for tree in .ab_base .; do
               name=$([ "$tree" = . ] && echo new || echo base)
               (cd "$tree" && PYTHONPATH=/tmp/site timeout 150 python3 "$OLDPWD/scripts/bench_prefill_graphs.py" \
                 --weights /tmp/smol-rand --out "$out/prefill_graphs_h200_$name$tag.json" 2>&1 | tail -12)
             done ;;
    overlap) # a prefill's first tokens with a decode step in flight: behind it on one stream, or beside it on the
             # engine's higher-priority side stream (model_kwargs.prefill_stream)
             timeout 200 python3 scripts/bench_prefill_overlap.py --weights /tmp/smol-rand \
               --out "$out/prefill_overlap_h200$tag.json" 2>&1 | tail -12 ;;
    streamab) # the single rank with ${INTAKES:-4} intakes, prefills beside the decode step in flight (the default)
             # against prefills behind it (prefill_stream: false), side by side, ${ROUNDS:-3} rounds at ${STREAMS:-1 32}
             intakes_config "${INTAKES:-4}"
             { cat /tmp/smollm2_single_intakes.yaml; echo "model_kwargs: {prefill_stream: false}"; } \
               > /tmp/smollm2_single_intakes_onestream.yaml
             timeout 420 python3 scripts/bench_serving.py --device cuda --model llama --rounds "${ROUNDS:-3}" \
               --max-tokens 256 --no-hf --no-eager-bare --streams ${STREAMS:-1 32} \
               --config /tmp/smollm2_single_intakes.yaml:1 --config /tmp/smollm2_single_intakes_onestream.yaml:1 \
               --out "$out/serving_h200_prefill_stream$tag.json" 2>&1 | tail -45 ;;
    knobab)  # the single rank with ${INTAKES:-4} intakes and model_kwargs {$KNOB} (e.g. KNOB="decode_yield_ms: 0")
             # against the defaults, side by side, ${ROUNDS:-3} rounds at ${STREAMS:-1 32 64} (REQUESTS_PER_STREAM=K: K
             # requests per client stream; SPP=N: N client streams per client process), into
             # serving_h200_knob_${NAME:-ab}.json; then (TRACE=1) the phase trace of the knob's deployment at 1 and 32
             # streams
             intakes_config "${INTAKES:-4}"
             { cat /tmp/smollm2_single_intakes.yaml; echo "model_kwargs: {${KNOB:?KNOB=\"key: value\"}}"; } \
               > /tmp/smollm2_single_intakes_knob.yaml
             timeout 540 python3 scripts/bench_serving.py --device cuda --model llama --rounds "${ROUNDS:-3}" \
               --max-tokens 256 --no-hf --no-eager-bare --streams ${STREAMS:-1 32 64} \
               ${REQUESTS_PER_STREAM:+--requests-per-stream $REQUESTS_PER_STREAM} ${SPP:+--streams-per-process $SPP} \
               --config /tmp/smollm2_single_intakes_knob.yaml:1 --config /tmp/smollm2_single_intakes.yaml:1 \
               --out "$out/serving_h200_knob_${NAME:-ab}$tag.json" 2>&1 | grep -A8 '"median_tok_s"\|"ttft_median_s"'
             [ "${TRACE:-0}" = 0 ] || timeout 150 python3 scripts/ttft_trace.py --device cuda --model llama --max-tokens 256 \
               --streams 1 32 ${REQUESTS_PER_STREAM:+--requests-per-stream $REQUESTS_PER_STREAM} \
               --config /tmp/smollm2_single_intakes_knob.yaml:1 --out "$out/ttft_trace_h200_knob_${NAME:-ab}$tag.json" 2>&1 \
               | grep -v "^W1\|^  \|Traceback\|^torch\|File " | tail -45 ;;
    kernels) # graph replay time, kernel counts and a torch.compile'd graph of decode steps and prefills (exploratory)
             timeout "${KERNELS_TIMEOUT:-480}" python3 scripts/bench_kernels.py --weights /tmp/smol-rand \
               --decode ${DECODE:-1 32} --prefill ${PREFILL:-1x48 32x48} --out "$out/kernels_h200${NAME:+_$NAME}.json" 2>&1 \
               | grep -v "^W1\|^  warnings" | tail -30 ;;
    attn)    # the in-place Triton decode attention and the fused pointwise kernels on CUDA: their tests, the graph-decode
             # and engine tests, then one decode step's GPU time with the kernel against SDPA over copies, and with the
             # fused kernels, at 1, 32 and 64 rows (rows at ${POSITION:-300}; PREFILL="RxL ...": prefills too)
             python3 -c "import triton; print('triton', triton.__version__)" || echo "triton: not importable"
             timeout 300 python3 -m pytest -q -p no:cacheprovider tests/unit/test_decode_attention.py \
               tests/unit/test_fused.py tests/unit/test_graph_decode.py tests/unit/test_kv_engine.py tests/gpu 2>&1 | tail -6
             timeout 240 python3 scripts/bench_kernels.py --weights /tmp/smol-rand --no-compile --decode ${DECODE:-1 32 64} \
               --prefill ${PREFILL:-} --position "${POSITION:-300}" --out "$out/kernels_h200_attn${NAME:+_$NAME}.json" 2>&1 \
               | grep -v "^W1\|^  warnings" | tail -8 ;;
    attnab)  # the single rank with ${INTAKES:-4} intakes, model_kwargs.decode_attention sdpa against the default (the
             # Triton kernel), side by side, ${ROUNDS:-2} rounds at ${STREAMS:-1 32 64}, ${REQUESTS_PER_STREAM:-4} requests
             # per stream; the CUDA-graph bare loop with the kernel
             intakes_config "${INTAKES:-4}"
             { cat /tmp/smollm2_single_intakes.yaml; echo "model_kwargs: {decode_attention: sdpa}"; } > /tmp/sdpa.yaml
             timeout 560 python3 scripts/bench_serving.py --device cuda --model llama --rounds "${ROUNDS:-2}" \
               --max-tokens 256 --no-hf --no-eager-bare --streams ${STREAMS:-1 32 64} \
               --requests-per-stream "${REQUESTS_PER_STREAM:-4}" --config /tmp/sdpa.yaml:1 \
               --config /tmp/smollm2_single_intakes.yaml:1 --out "$out/serving_h200_attn${NAME:+_$NAME}$tag.json" 2>&1 \
               | grep -A8 '"median_tok_s"\|"ttft_median_s"' ;;
    gatherab) # the single rank with ${INTAKES:-4} intakes and model_kwargs {prefill_gather_ms: G} for each G of
             # ${GATHER:-0.25 0.6} against the default (0), side by side, ${ROUNDS:-2} rounds at ${STREAMS:-1 32 64},
             # ${REQUESTS_PER_STREAM:-6} requests per stream, into serving_h200_gather${NAME:+_$NAME}.json
             intakes_config "${INTAKES:-4}"
             cfgs=""
             for g in ${GATHER:-0.25 0.6}; do
               f="/tmp/gather_${g/./p}ms.yaml"
               { cat /tmp/smollm2_single_intakes.yaml; echo "model_kwargs: {prefill_gather_ms: $g}"; } > "$f"
               cfgs="$cfgs --config $f:1"
             done
             timeout 560 python3 scripts/bench_serving.py --device cuda --model llama --rounds "${ROUNDS:-2}" \
               --max-tokens 256 --no-hf --no-eager-bare --streams ${STREAMS:-1 32 64} \
               --requests-per-stream "${REQUESTS_PER_STREAM:-6}" $cfgs --config /tmp/smollm2_single_intakes.yaml:1 \
               --out "$out/serving_h200_gather${NAME:+_$NAME}$tag.json" 2>&1 | grep -A8 '"median_tok_s"\|"ttft_median_s"' ;;
    clientab) # the single rank with ${INTAKES:-4} intakes measured by bench_serving's asyncio client against its
             # thread-per-stream client (the one of earlier sessions), alternating, ${PAIRS:-2} pairs at ${STREAMS:-1 32};
             # then the phase trace with the asyncio client (TRACE=0 skips it)
             intakes_config "${INTAKES:-4}"
             for i in $(seq "${PAIRS:-2}"); do
               for client in threads async; do
                 timeout 150 python3 scripts/bench_serving.py --device cuda --model llama --rounds 1 --max-tokens 256 \
                   --no-hf --no-eager-bare --streams ${STREAMS:-1 32} --client "$client" \
                   --config /tmp/smollm2_single_intakes.yaml:1 --out "$out/serving_h200_client_${client}_$i$tag.json" 2>&1 \
                   | grep -A3 '"median_tok_s"\|"ttft_median_s"\|"server_ttft_mean_s"'
               done
             done
             [ "${TRACE:-1}" = 0 ] || timeout 150 python3 scripts/ttft_trace.py --device cuda --model llama --max-tokens 256 \
               --streams 1 32 --config /tmp/smollm2_single_intakes.yaml:1 --out "$out/ttft_trace_h200_async_client$tag.json" \
               --events-out "$out/ttft_trace_h200_async_client$tag.events.jsonl" 2>&1 \
               | grep -v "^W1\|^  \|Traceback\|^torch\|File " | tail -45 ;;
    intaketrace) # the phase trace of the single rank with ${INTAKES:-4} intakes at 1 and 32 streams
             # (REQUESTS_PER_STREAM=K: K requests per client stream), then (with ALSO8=1) tok/s and TTFT with 8 intakes,
             # one round (knobab TRACE=1 traces a deployment with other model_kwargs)
             intakes_config "${INTAKES:-4}"
             timeout 150 python3 scripts/ttft_trace.py --device cuda --model llama --max-tokens 256 --streams 1 32 \
               ${REQUESTS_PER_STREAM:+--requests-per-stream $REQUESTS_PER_STREAM} \
               --config /tmp/smollm2_single_intakes.yaml:1 --out "$out/ttft_trace_h200_intakes${INTAKES:-4}$tag.json" \
               --events-out "$out/ttft_trace_h200_intakes${INTAKES:-4}$tag.events.jsonl" 2>&1 \
               | grep -v "^W1\|^  \|Traceback\|^torch\|File " | tail -45
             if [ "${ALSO8:-0}" = 1 ]; then
               intakes_config 8
               timeout 150 python3 scripts/bench_serving.py --device cuda --model llama --rounds 1 --max-tokens 256 \
                 --no-hf --no-eager-bare --streams 1 32 --config /tmp/smollm2_single_intakes.yaml:1 \
                 --out "$out/serving_h200_intakes8_async$tag.json" 2>&1 | grep -A3 '"median_tok_s"\|"ttft_median_s"'
             fi ;;
    intakes48) # the single rank with 4 against 8 HTTP intake processes, side by side, ${ROUNDS:-2} rounds at
             # ${STREAMS:-1 32 64} streams (REQUESTS_PER_STREAM=K: K requests per client stream)
             intakes_config 8 && mv /tmp/smollm2_single_intakes.yaml /tmp/smollm2_single_intakes8.yaml
             intakes_config 4
             timeout 540 python3 scripts/bench_serving.py --device cuda --model llama --rounds "${ROUNDS:-2}" \
               --max-tokens 256 --no-hf --no-eager-bare --streams ${STREAMS:-1 32 64} \
               ${REQUESTS_PER_STREAM:+--requests-per-stream $REQUESTS_PER_STREAM} \
               --config /tmp/smollm2_single_intakes.yaml:1 --config /tmp/smollm2_single_intakes8.yaml:1 \
               --out "$out/serving_h200_intakes48$tag.json" 2>&1 | grep -A8 '"median_tok_s"\|"ttft_median_s"' ;;
    pinab)   # the single rank with ${INTAKES:-4} intakes, the clients pinned to CPUs ${CLIENT_CPUS:-8-15} (the server on the
             # others) against no pinning, alternating, one round each, ${PAIRS:-2} pairs, at ${STREAMS:-1 32 64} streams
             intakes_config "${INTAKES:-4}"
             for i in $(seq "${PAIRS:-2}"); do
               for pin in "--client-cpus ${CLIENT_CPUS:-8-15}" ""; do
                 name=$([ -n "$pin" ] && echo pinned || echo unpinned)
                 timeout 150 python3 scripts/bench_serving.py --device cuda --model llama --rounds 1 --max-tokens 256 \
                   --no-hf --no-eager-bare --streams ${STREAMS:-1 32 64} $pin --config /tmp/smollm2_single_intakes.yaml:1 \
                   --out "$out/serving_h200_pinab_${name}_$i$tag.json" 2>&1 | grep -A4 '"median_tok_s"\|"ttft_median_s"'
               done
             done ;;
    firstuse) # a CUDA graph's first replay and pinned host memory's first use, against the next ones (host time)
             timeout 60 python3 scripts/bench_first_use.py --out "$out/first_use_h200.json" 2>&1 | tail -30 ;;
    engine)  # the engine's CUDA tests: decode and prefill graphs, lookahead
             timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/test_kv_engine.py \
               tests/unit/test_graph_decode.py 2>&1 | tail -4 ;;
    ttft)    # the single rank at 1 and 32 streams: TTFT, and how the engine batched prefills and decode steps
             timeout 200 python3 scripts/bench_serving.py --device cuda --model llama --rounds 1 --max-tokens 256 --no-hf \
               --no-eager-bare --streams 1 32 --config launch/configs/smollm2_single.yaml:1 --out "$out/serving_h200_ttft$tag.json" 2>&1 \
               | tail -40 ;;
    ttftrace) # where the 32-stream TTFT goes: the phase trace (MSTAR_DIST_TRACE_DIR) of the single rank at 1 and 32 streams
             timeout 150 python3 scripts/ttft_trace.py --device cuda --model llama --max-tokens 256 --streams 1 32 \
               --config launch/configs/smollm2_single.yaml:1 --out "$out/ttft_trace_h200$tag.json" \
               --events-out "$out/ttft_trace_h200$tag.events.jsonl" 2>&1 | tail -45 ;;
    ttftrace_pd) # the same for P/D on the pair at 1 and 8 streams: the handoff (push, descriptor, landed) in the events
             timeout 150 python3 scripts/ttft_trace.py --device cuda --model llama --max-tokens 256 --streams 1 8 \
               --config launch/configs/smollm2_pd.yaml:2 --out "$out/ttft_trace_h200x2_pd.json" \
               --events-out "$out/ttft_trace_h200x2_pd.events.jsonl" 2>&1 | tail -45 ;;
    profile) # py-spy of rank 0, the front end and the intakes at ${PSTREAMS:-32} streams, ${INTAKES:-1} HTTP processes
             timeout 90 python3 scripts/profile_serving.py --model llama --streams "${PSTREAMS:-32}" --seconds 8 \
               --http-processes "${INTAKES:-1}" \
               --waves "${PWAVES:-12}" --out "$out/profile_h200_single${PNAME:-}$tag.json" 2>&1 | tail -60 ;;
    edges)   # ping-pong one-way times and windowed bandwidth (receivers spin as GPU ranks do), then the same without spin
             timeout 240 torchrun --standalone --nproc-per-node 2 scripts/bench_edges.py --device cuda \
               --out "$out/edges_h200x2.json" 2>&1 | tail -20
             timeout 200 torchrun --standalone --nproc-per-node 2 scripts/bench_edges.py --device cuda --spin-us 0 \
               --out "$out/edges_h200x2_nospin.json" 2>&1 | tail -12 ;;
    split)   # P/D on the pair against the single rank at 1 stream: end-to-end p50 of the same requests (split overhead)
             timeout 300 python3 scripts/bench_serving.py --device cuda --model llama --rounds 3 --max-tokens 256 --no-hf \
               --no-eager-bare --streams 1 --config launch/configs/smollm2_pd.yaml:2 \
               --config launch/configs/smollm2_single.yaml:1 --out "$out/serving_h200x2_split.json" 2>&1 | tail -40 ;;
    composite) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_composite_cuda.py 2>&1 | tail -15 ;;
    speech)  python3 scripts/bench_composite.py speech --make 3b --weights /tmp/orpheus-3b --streams 1 8 32 \
               --max-tokens 560 --out "$out/speech_h200x2.json" 2>&1 | tail -30 ;;
    image)   python3 scripts/bench_composite.py image --make 1b --weights /tmp/bagel-1b --size 1024 --steps 8 24 \
               --out "$out/image_h200x2.json" 2>&1 | tail -30 ;;
    twohost) timeout -k 30 480 python3 scripts/gpu_two_host.py --device cuda --budget 440 \
               --out "$out/two_host_h200x2.json" 2>&1 | tail -80 ;;
    soak)    # detached: starts a ${SOAK_SECONDS:-600} s soak unless one is in /tmp/soak, waits up to SOAK_WAIT s;
             # collect the rest at once in the next command: bash scripts/gpu_soak.sh collect 540
             bash scripts/gpu_soak.sh auto "${SOAK_SECONDS:-600}" "${SOAK_WAIT:-480}" 2>&1 | tail -60 ;;
    h11)     # the steps after it run without httptools (uvicorn parses with h11), to compare with those before
             h11_site && export PYTHONPATH="/tmp/site_h11:$PWD" && tag="_h11" ;;
    parserab) # the single rank with ${INTAKES:-4} intakes, uvicorn parsing with httptools against h11, alternating,
             # ${PAIRS:-3} pairs at ${STREAMS:-1 32 64} streams (REQUESTS_PER_STREAM=K: K requests per client stream);
             # first the HTTP path's server CPU per request over a loopback socket, the two parsers alternated
             timeout 120 python3 scripts/bench_http_path.py --socket --requests 3000 --rounds 3 \
               --out "$out/http_path_socket_h200.json" 2>&1 | tail -1
             h11_site
             intakes_config "${INTAKES:-4}"
             for i in $(seq "${PAIRS:-3}"); do
               for parser in h11 httptools; do
                 site=$([ "$parser" = h11 ] && echo /tmp/site_h11 || echo /tmp/site)
                 PYTHONPATH="$site:$PWD" timeout 150 python3 scripts/bench_serving.py --device cuda --model llama \
                   --rounds 1 --max-tokens 256 --no-hf --no-eager-bare --streams ${STREAMS:-1 32 64} \
                   ${REQUESTS_PER_STREAM:+--requests-per-stream $REQUESTS_PER_STREAM} \
                   --config /tmp/smollm2_single_intakes.yaml:1 --out "$out/serving_h200_parser_${parser}_$i.json" 2>&1 \
                   | grep -A4 '"median_tok_s"\|"ttft_median_s"'
               done
             done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
