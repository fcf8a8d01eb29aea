export PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/test
for v in on off; do
  echo "=== overlap $v"
  python3 tp_debug.py $v > $OUT/dbg_$v.log 2>&1 &
  pid=$!
  for i in $(seq 60); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  if kill -0 $pid 2>/dev/null; then
    echo "HUNG: dumping"; pkill -ABRT -f "[s]pawn_main"; sleep 1; kill -ABRT $pid; sleep 3
    pkill -9 -f "[s]pawn_main"; kill -9 $pid 2>/dev/null
  fi
  grep -v capturing $OUT/dbg_$v.log | grep -v "INFO" | head -150
done
