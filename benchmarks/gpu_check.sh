#!/usr/bin/env bash
# The GPU checks CI cannot run, as one script for a machine with one or more CUDA GPUs
# (`bash benchmarks/gpu_check.sh [OUT_DIR]`, from the repository root, with yatt's
# requirements installed or on PYTHONPATH). Each part has its own time limit and log in
# OUT_DIR (default gpu-check/; the runs and the model go to WORK, default OUT_DIR/work); a
# part that fails does not stop the next one.
#
#   1. pytest -m gpu: the tests that need CUDA (FSDP2 on NCCL; vLLM's where it is installed)
#   2. the default job on the GPU (one trainer rank: one GPU per rank): does it learn,
#      and at what step time (metrics.jsonl, eval.jsonl of its run dir)
#   3. python -m benchmarks stages on the GPU with a wider model built from a config
#      (hidden 1024, 16 layers: ~200M parameters, random weights, the default job's
#      tokenizer): where a step's time goes, the framework's share of it
#   4. the machine's bf16 matmul peak (the ceiling the planner measures and predicts with)
#
# Every part prints its figures on the last lines of its log; gpu_check.log has them all.
set -u
OUT=${1:-${OUT:-gpu-check}}
WORK=${WORK:-$OUT/work}
mkdir -p "$OUT" "$WORK"
WORK=$(cd "$WORK" && pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
LOG="$OUT/gpu_check.log"

part() {  # part NAME LIMIT_S COMMAND...: run one part under its limit, its output in OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log" | tee -a "$LOG"
    echo "=== $name rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import sys, torch, transformers, zmq; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'pyzmq', zmq.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
} 2>&1 | tee -a "$LOG"

part pytest_gpu 150 $PY -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/workers/test_trainer.py tests/workers/engines/test_engines.py tests/e2e/test_loop.py

part default_job 150 $PY -m launch run trainer.world_size=1 --run-dir "$WORK/default-run" --no-progress
$PY - "$WORK/default-run" "$OUT/default_metrics.jsonl" <<'EOF' 2>&1 | tee -a "$LOG"
import json, statistics, sys
from pathlib import Path
run = Path(sys.argv[1])
steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()] if (run / "metrics.jsonl").exists() else []
(run / "metrics.jsonl").exists() and __import__("shutil").copy(run / "metrics.jsonl", sys.argv[2])
walls = [s["time/step_s"] for s in steps if "time/step_s" in s]
print(f"default job: {len(steps)} steps; median step {statistics.median(walls):.3f} s" if walls else f"default job: {len(steps)} steps")
if (run / "eval.jsonl").exists():
    for line in (run / "eval.jsonl").read_text().splitlines():
        row = json.loads(line)
        print("eval", {k: v for k, v in row.items() if k in ("step", "eval/reward/accuracy")})
EOF

$PY -c "from workers.models import build_tiny_model; build_tiny_model('$WORK/wide-model', hidden_size=1024, num_layers=16, num_heads=16)" >>"$LOG" 2>&1
part stages_wide 180 $PY -m benchmarks stages --out "$OUT" --set steps=12 \
    --set "overrides=[model.path=$WORK/wide-model, model.dtype=bfloat16, trainer.world_size=1, buffer.groups_per_step=32, controller.max_new_tokens=8]"

part matmul_peak 40 $PY -c "
from launch.placement.inputs import measure_peak_flops
for dt in ('bfloat16', 'float32'):
    for n in (1024, 8192):  # 1024: what the planner measures at the start of a run
        print(f'{dt} {n}x{n}: {measure_peak_flops(device=\"cuda:0\", dtype=dt, size=n, seconds=1.0) / 1e12:.0f} TFLOP/s')
"
echo "done" | tee -a "$LOG"
