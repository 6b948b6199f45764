#!/usr/bin/env bash
# Run every GPU test and benchmark in one call and print one table.
#   bash benchmarks/run_gpu.sh [results.jsonl]
# Needs a CUDA machine with torch and triton; megatron-core (and torchao for the module benchmarks) must be
# importable. Multi-GPU tests run when 2+ GPUs are visible.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=$(realpath -m "${1:-bench_results.jsonl}")
rm -f "$out"
status=0
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPUs')"
# the compiled host path (fp8_parallel/csrc), built in place unless a build is there or FP8_PARALLEL_NATIVE=0
if [ "${FP8_PARALLEL_NATIVE:-1}" != 0 ] && ! ls fp8_parallel/_native*.so >/dev/null 2>&1; then
  python3 setup.py -q build_ext --inplace >build_native.log 2>&1 || { echo "native build failed: build_native.log"; status=1; }
fi
python3 -c "from fp8_parallel import native; m = native.module(); print('compiled host path:', 'CUDA build' if m is not None and m.with_cuda else 'not built (Python path)')"
# the GPU tests in parallel processes (one GPU each; multi-GPU tests see all): about 2.5 minutes on two H200s
timeout 600 python3 benchmarks/gpu_test_shards.py --timeout 540 2>&1 | grep -v Warning || status=1
# the slow tests (CPU ranks, CUDA hidden), which the default `pytest tests` leaves out
echo "== pytest -m slow"
timeout 1200 python3 -m pytest -q -m slow -n 0 -p no:cacheprovider tests 2>&1 | tail -n 5 || status=1
for b in benchmarks/bench_*.py; do
  echo "== $b"
  (cd benchmarks && timeout 600 python3 "$(basename "$b")" "$out") || status=1
done
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  for layout in "--tp 2 --sp" "--pp 2 --vpp 2"; do
    echo "== bench_e2e.py $layout (2 GPUs)"
    (cd benchmarks && timeout 600 python3 -m torch.distributed.run --nproc_per_node=2 bench_e2e.py "$out" $layout) || status=1
  done
fi
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"\n{'bench':14s} {'case':38s} {'metric':9s} {'value':>11s}  {'ratio vs':24s} {'ratio':>7s}")
for r in rows:
    print(f"{r['bench']:14s} {r['case']:38s} {r['metric']:9s} {r['value']:11.3f}  {r['baseline']:24s} {r['ratio']:7.3f}")
PY
exit $status
