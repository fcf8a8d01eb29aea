python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/python:$PWD/test
SA=('{}' '{"chunked_prefill_size": 8192, "prefill_cuda_graph_max_tokens": 2048}' '{"chunked_prefill_size": 16384, "prefill_cuda_graph_max_tokens": 2048}')
L=benchmark/configs/llama-3.1-8b.json
timeout -s INT 150 python3 benchmark/bench_offline.py --model-path $L --modes full --num-seqs 64 --min-len 512 --max-len 512 --output-len 1 --server-args "${SA[@]}" --json $OUT/prefill64_llama.json > $OUT/prefill64.log 2>&1; echo "prefill rc=$?"; grep "^|" $OUT/prefill64.log
timeout -s INT 200 python3 benchmark/bench_offline.py --modes full --server-args "${SA[@]}" --json $OUT/offline_qwen3.json > $OUT/offline_qwen3.log 2>&1; echo "qwen3 rc=$?"; grep "^|" $OUT/offline_qwen3.log
timeout -s INT 200 python3 benchmark/bench_offline.py --model-path $L --modes full --server-args "${SA[@]}" --json $OUT/offline_llama.json > $OUT/offline_llama.log 2>&1; echo "llama rc=$?"; grep "^|" $OUT/offline_llama.log
