#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py (tag core_v0.16.1) with `--spec fp8_parallel.megatron_lm block_spec` on two
# GPUs, TP2 + sequence parallel:
#   (a) BF16, 30 iterations (the same command without --fp8-format)
#   (b) FP8 hybrid, 30 iterations
#   (c) FP8 hybrid, 15 iterations, --save DIR --save-interval 15 --exit-interval 15
#   (d) FP8 hybrid, --load DIR, continuing to 30
#   (e) float32 (the same command without --bf16): the precision reference
# and prints one table with PASS/FAIL for: max rel diff FP8 vs BF16 within BF16's own max rel diff from FP32
# (on CPU, where the baseline is float32: <= 0.2%); losses 16-30 of (d) equal (b).
#
#   bash benchmarks/megatron_lm_gpu.sh [--cpu] MEGATRON_LM_DIR [OUTDIR]
#
# MEGATRON_LM_DIR holds pretrain_gpt.py (a core_v0.16.1 checkout, or just pretrain_gpt.py, gpt_builders.py,
# model_provider.py and megatron/{training,legacy,rl} from it). megatron.core must be the installed
# megatron-core 0.16.1 (its wheel ships the dataset helpers built); both `megatron` folders are namespace
# packages, so the checkout's megatron.training and the installed megatron.core import side by side.
# fp8_parallel comes from this repository (put on PYTHONPATH here).
#
# Megatron-LM's start-up runs `make -C <megatron/core/datasets>` on rank 0 (the wheel ships no Makefile) and
# `nvcc -V` for the legacy fused kernels. Where the installed helpers import and that folder has no
# Makefile, this script writes one whose only target is the built helpers file (up to date: make does
# nothing), and the runs are plain `torchrun pretrain_gpt.py`. Where `make` or nvcc is missing, the runs go
# through launch/megatron_lm_cpu.py --skip-build-steps instead, which skips just those two steps (the log
# says which).
#
# --cpu: the same four runs on CPU (gloo, fp32, tiny model, 8 iterations, save/exit at 4) through
# launch/megatron_lm_cpu.py, one at a time; checks the parsing, the save/exit/load and the import layout.
#
# Environment: MLM_PARSE_ONLY=1 (no runs: print the table from the logs in OUTDIR), MLM_TIMEOUT (seconds per run, default 300; 1500 with --cpu), MLM_PARALLEL (GPU: 1 runs
# (a), (b) and (c) at the same time on the two GPUs, 0 one after another; default 1), CKPT_DIR (default: a
# fresh temporary folder, removed at the end).
set -uo pipefail

CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
if [ $# -lt 1 ] || [ ! -f "$1/pretrain_gpt.py" ]; then
  echo "usage: $0 [--cpu] MEGATRON_LM_DIR [OUTDIR]  (MEGATRON_LM_DIR must hold pretrain_gpt.py)" >&2
  exit 2
fi
MLM=$(cd "$1" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUTDIR=$(realpath -m "${2:-$REPO/runs/megatron_lm_gpu}")
mkdir -p "$OUTDIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONUNBUFFERED=1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO"
CKPT=${CKPT_DIR:-$(mktemp -d)}
[ -z "${CKPT_DIR:-}" ] && trap 'rm -rf "$CKPT"' EXIT
rm -rf "$CKPT/fp8"

python3 - <<'PY' || exit 2
import importlib.util, sys, torch
import megatron.core
from megatron.core.package_info import __version__
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA devices: {torch.cuda.device_count()}")
print(f"megatron-core {__version__} from {megatron.core.__path__[0]}")
print("dataset helpers built:", importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None)
if __version__ != "0.16.1":
    print("WARNING: megatron-core is not 0.16.1, the version core_v0.16.1's pretrain_gpt.py goes with")
try:  # megatron.training imports megatron.rl, whose __init__ needs pydantic
    import pydantic, typing_extensions
    print(f"pydantic {pydantic.VERSION}")
except Exception as e:
    print(f"WARNING: pydantic does not import ({type(e).__name__}: {e}); megatron.training will not either")
PY

if [ "$CPU" = 1 ]; then
  ITERS=8; HALF=4; TIMEOUT=${MLM_TIMEOUT:-1500}; PARALLEL=0
  LAUNCH=(python3 -m torch.distributed.run --nproc_per_node=2)
  SCRIPT=("$REPO/launch/megatron_lm_cpu.py" --megatron-lm "$MLM" --)
  SIZE=(--distributed-backend gloo --use-cpu-initialization
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
        --micro-batch-size 2 --global-batch-size 4 --vocab-size 128)
  PRECISION=()
  MODE="CPU (gloo, fp32) through launch/megatron_lm_cpu.py"
else
  ITERS=30; HALF=15; TIMEOUT=${MLM_TIMEOUT:-300}; PARALLEL=${MLM_PARALLEL:-1}
  LAUNCH=(python3 -m torch.distributed.run --nproc_per_node=2)
  SIZE=(--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256
        --micro-batch-size 4 --global-batch-size 8 --vocab-size 1024)
  PRECISION=(--bf16)
  # what compile_helpers (`make -C DIR`) and fused_kernels.load (`$CUDA_HOME/bin/nvcc -V`) will meet
  BUILD=$(python3 - <<'PY'
import importlib.util, os
from torch.utils import cpp_extension
spec = importlib.util.find_spec("megatron.core.datasets.helpers_cpp")
if spec is not None:
    folder, built = os.path.split(spec.origin)
    makefile = os.path.join(folder, "Makefile")
    if not os.path.exists(makefile):
        try:
            with open(makefile, "w") as f:
                f.write("# megatron-core's wheel ships the dataset helpers built; Megatron-LM's start-up runs\n"
                        "# `make` here: the built file is the only target and it is up to date.\n"
                        f"default: {built}\n")
        except OSError:
            pass
    print(folder)
else:
    print("-")
print(cpp_extension.CUDA_HOME or "-")
PY
)
  HELPERS_DIR=$(echo "$BUILD" | sed -n 1p); CUDA_HOME_SEEN=$(echo "$BUILD" | sed -n 2p)
  WHY=""
  if [ "$HELPERS_DIR" = "-" ]; then WHY="megatron-core's dataset helpers are not built"
  elif ! command -v make >/dev/null; then WHY="no make"
  elif ! make -s -C "$HELPERS_DIR" >/dev/null 2>"$OUTDIR/make.err"; then WHY="make -C $HELPERS_DIR fails ($(head -c 200 "$OUTDIR/make.err"))"
  fi
  if [ -z "$WHY" ] && ! "$CUDA_HOME_SEEN/bin/nvcc" -V >/dev/null 2>&1; then WHY="no nvcc under CUDA_HOME ($CUDA_HOME_SEEN)"; fi
  if [ -z "$WHY" ]; then
    SCRIPT=("$MLM/pretrain_gpt.py")
    MODE="plain torchrun pretrain_gpt.py (make -C $HELPERS_DIR: nothing to do; nvcc under $CUDA_HOME_SEEN)"
  else
    SCRIPT=("$REPO/launch/megatron_lm_cpu.py" --megatron-lm "$MLM" --skip-build-steps --)
    MODE="launch/megatron_lm_cpu.py --skip-build-steps (a GPU run with Megatron-LM's build steps skipped: $WHY)"
  fi
fi
echo "mode: $MODE"

COMMON=(--spec fp8_parallel.megatron_lm block_spec --transformer-impl local
        --tensor-model-parallel-size 2 --sequence-parallel
        --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion
        --no-bias-gelu-fusion --no-rope-fusion --no-persist-layer-norm
        "${SIZE[@]}" --train-iters "$ITERS" --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine
        --mock-data --tokenizer-type NullTokenizer --log-interval 1 --eval-iters 0 --eval-interval 1000
        --seed 1234)
# our recipe's (TransformerEngine's) amax defaults, not megatron's (history 1, most_recent)
FP8=(--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max)

PORT=$((29500 + RANDOM % 2000))
run() {  # run NAME PORT ARGS...: one torchrun, its log in OUTDIR/NAME.log
  local name=$1 port=$2; shift 2
  local start=$SECONDS
  (cd "$OUTDIR" && timeout -k 15 "$TIMEOUT" "${LAUNCH[@]}" --master_port="$port" "${SCRIPT[@]}" "${COMMON[@]}" "${PRECISION[@]}" "$@" \
     > "$OUTDIR/$name.log" 2>&1)
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUTDIR/exit_codes.txt"
}
T0=$SECONDS
if [ "${MLM_PARSE_ONLY:-0}" = 1 ]; then
  echo "MLM_PARSE_ONLY=1: reading the logs already in $OUTDIR"
elif [ "$PARALLEL" = 1 ]; then
  rm -f "$OUTDIR/exit_codes.txt"
  run bf16 $((PORT + 1)) &
  run fp8 $((PORT + 2)) "${FP8[@]}" &
  run fp8_first_half $((PORT + 3)) "${FP8[@]}" --save "$CKPT/fp8" --save-interval "$HALF" --exit-interval "$HALF" &
  wait
  run fp8_resumed $((PORT + 4)) "${FP8[@]}" --load "$CKPT/fp8" &
  # a precision reference for the BF16-vs-FP8 distance: the same run in float32 (no --bf16)
  (PRECISION=(); run fp32 $((PORT + 5))) &
  wait
else
  rm -f "$OUTDIR/exit_codes.txt"
  run bf16 $((PORT + 1))
  run fp8 $((PORT + 2)) "${FP8[@]}"
  run fp8_first_half $((PORT + 3)) "${FP8[@]}" --save "$CKPT/fp8" --save-interval "$HALF" --exit-interval "$HALF"
  run fp8_resumed $((PORT + 4)) "${FP8[@]}" --load "$CKPT/fp8"
fi
echo "all runs: $((SECONDS - T0)) s"

python3 - "$OUTDIR" "$ITERS" "$HALF" "$MODE" <<'PY' | tee "$OUTDIR/summary.txt"
import math, re, sys
from pathlib import Path

out, iters, half, mode = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ITER, LOSS, GRAD = (re.compile(p) for p in (r" iteration\s+(\d+)/\s*\d+ \|", r"\| lm loss: (\S+) \|",
                                              r"\| grad norm: (\S+) \|"))


def parse(name):
    """{iteration: (lm loss, grad norm, derived)} from Megatron-LM's log lines, and the log text.

    core_v0.16.1's training_log does not reset its loss sums after a run's first logged iteration
    (`should_reset = not is_first_iteration`), so with --log-interval 1 the line of a run's second iteration
    prints the mean of its first two. That iteration's own loss is 2 * printed - first (derived=True)."""
    rows = {}
    path = out / f"{name}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    for line in text.splitlines():
        it, loss, grad = ITER.search(line), LOSS.search(line), GRAD.search(line)
        if it and loss:
            rows[int(it.group(1))] = [loss.group(1), grad.group(1) if grad else None, False]
    if rows and min(rows) + 1 in rows:
        k = min(rows)
        rows[k + 1][0] = "%.6E" % (2 * float(rows[k + 1][0]) - float(rows[k][0]))
        rows[k + 1][2] = True
    return rows, text


def ulp(printed):  # one unit in the last printed digit of a %.6E number
    return 10.0 ** (math.floor(math.log10(abs(float(printed)))) - 6) if float(printed) else 1e-12


def equal(a, b):  # as printed; a derived value carries the rounding of the two printed numbers it comes from
    if not (a[2] or b[2]):
        return a[0] == b[0]
    return abs(float(a[0]) - float(b[0])) <= 3 * max(ulp(a[0]), ulp(b[0]))


names = ("bf16", "fp8", "fp8_first_half", "fp8_resumed")
runs = {n: parse(n) for n in names}
bf16, fp8, first, resumed = (runs[n][0] for n in names)
base = "BF16" if "CPU" not in mode else "no-FP8"
print(f"\nMegatron-LM pretrain_gpt.py, --spec fp8_parallel.megatron_lm block_spec, TP2 + SP; {mode}")
print(f"resumed: iterations 1-{half} from the run that saved at {half} and exited, {half + 1}-{iters} from the "
      "run with --load; * = the run's second iteration, derived (Megatron-LM prints the mean of its first two)")
print(f"{'iter':>4} {base + ' loss':>14} {'FP8 loss':>14} {'rel diff':>9} {'resumed loss':>14}  grad norm FP8/resumed")
NONE = (None, None, False)
for it in range(1, iters + 1):
    b, f = bf16.get(it, NONE), fp8.get(it, NONE)
    r = (first if it <= half else resumed).get(it, NONE)
    rel = f"{abs(float(f[0]) - float(b[0])) / abs(float(b[0])) * 100:8.4f}%" if b[0] and f[0] else f"{'-':>9}"
    cell = lambda x: (x[0] + ("*" if x[2] else " ")) if x[0] else "- "
    print(f"{it:4d} {cell(b):>14} {cell(f):>14} {rel} {cell(r):>14}  {f[1] or '-'}/{r[1] or '-'}")

ok = True
expect = {"bf16": range(1, iters + 1), "fp8": range(1, iters + 1), "fp8_first_half": range(1, half + 1),
          "fp8_resumed": range(half + 1, iters + 1)}
missing = [n for n in names if sorted(runs[n][0]) != list(expect[n])]
if missing:
    ok = False
    print("FAIL: runs without all their iterations logged:", ", ".join(missing), "(see their logs)")
loaded = re.search(r"successfully loaded checkpoint from .* at iteration (\d+)", runs["fp8_resumed"][1])
print(f"resumed run loaded the checkpoint at iteration: {loaded.group(1) if loaded else 'NOT FOUND'}")
both = [it for it in bf16 if it in fp8]
fp32 = parse("fp32")[0]  # GPU runs: the same run in float32, the precision reference


def max_rel(run, ref, its):
    rel = {it: abs(float(run[it][0]) - float(ref[it][0])) / abs(float(ref[it][0])) for it in its}
    worst = max(rel, key=rel.get)
    return rel[worst], worst, sum(rel.values()) / len(rel)


if both:
    worst, at, mean = max_rel(fp8, bf16, both)
    complete = len(both) == iters
    line = f"max rel diff FP8 vs {base} over iterations 1-{iters}: {worst * 100:.4f}% (iteration {at}); mean {mean * 100:.4f}%"
    common = [it for it in both if it in fp32]
    if fp32 and len(common) == iters:
        # the bar: FP8 stays as close to BF16 as BF16 itself stays to float32 on the same run
        bar, bar_at, bar_mean = max_rel(bf16, fp32, common)
        verdict = "PASS" if worst <= bar and complete else "FAIL"
        print(f"{verdict}: {line}, within BF16's own distance from FP32: max {bar * 100:.4f}% (iteration {bar_at}); "
              f"mean {bar_mean * 100:.4f}%")
        print(f"info: {'within' if worst <= 0.002 else 'NOT within'} 0.2% of BF16 (the figure first reported "
              "with an adapter module)")
        print(f"{'iter':>4} {'FP32 loss':>14} {'BF16 vs FP32':>13} {'FP8 vs FP32':>12}")
        for it in common:
            f32 = float(fp32[it][0])
            print(f"{it:4d} {fp32[it][0]:>14} {(float(bf16[it][0]) - f32) / f32 * 100:12.4f}% "
                  f"{(float(fp8[it][0]) - f32) / f32 * 100:11.4f}%")
        f8, f8_at, f8_mean = max_rel(fp8, fp32, common)
        print(f"info: max rel diff FP8 vs FP32: {f8 * 100:.4f}% (iteration {f8_at}); mean {f8_mean * 100:.4f}%")
    else:  # no float32 reference (CPU: the baseline is float32 already)
        verdict = "PASS" if worst <= 0.002 and complete else "FAIL"
        print(f"{verdict}: {line} <= 0.2%" + ("" if base != "BF16" else " (no FP32 run to compare BF16 with)"))
    ok &= verdict == "PASS"
else:
    ok = False
    print(f"FAIL: max rel diff FP8 vs {base}: no losses to compare")
tail = range(half + 1, iters + 1)
same = [it for it in tail if it in resumed and it in fp8 and equal(resumed[it], fp8[it])]
differ = [it for it in tail if it not in same]
verdict = "PASS" if not differ and loaded else "FAIL"
ok &= verdict == "PASS"
print(f"{verdict}: resumed losses {half + 1}-{iters} equal the straight run (as printed, 7 digits): "
      f"{len(same)}/{len(tail)} equal" + (f"; differ at {differ}" if differ else ""))
gn = [it for it in tail if it in resumed and it in fp8 and resumed[it][1] == fp8[it][1]]
print(f"info: resumed grad norms {half + 1}-{iters} equal the straight run (as printed): {len(gn)}/{len(tail)}")
head = [it for it in range(1, half + 1) if it in first and it in fp8 and first[it][:2] == fp8[it][:2]]
print(f"info: the saving run's iterations 1-{half} equal the straight run's (loss and grad norm as printed; "
      f"run-to-run determinism): {len(head)}/{half}")
print("RESULT:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
status=$?
echo "logs: $OUTDIR"
exit $status
