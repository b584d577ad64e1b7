#!/usr/bin/env bash
# Every GPU test and benchmark of the project, on a machine with CUDA (290 s on one H200, 2026-12-04).
#
#     bash benchmarks/gpu_check.sh            # PYTHON=python3 by default: a Python that has torch with CUDA
#     LOG_DIR=DIR bash benchmarks/gpu_check.sh   # each step's output also in DIR/<step>.log (default out/gpu-logs)
#
# 1. The CUDA extensions of cuda/ built just in time (nvcc, in parallel), while the emitted train.py runs with NCCL
#    against one process on one GPU (tests/gpu/test_nccl_runs.py; plans needing more GPUs than the machine has are
#    skipped and say so).
# 2. The kernels against their pure-torch references (the other tests marked gpu).
# 3. benchmarks/gpu_kernels.py: each kernel against what it replaces (cuBLAS bf16 for the weight-only GEMV).
# 4. benchmarks/gpu_measured_vs_predicted.py: a 0.95B Hugging Face Llama's measured step time against the plan's
#    prediction at 4k and 16k tokens, and the attention kernel's achieved rate against the profile's.
# 5. benchmarks/gpu_step_breakdown.py: one decoder block's GEMMs, attention and the rest against their prices.
# 6. examples/tiny.py compiled for one GPU of dgx-h200 and trained 30 steps from its emitted script.
# 7. benchmarks/gpu_host_overhead.py: the host's seconds per aten op apart, against the GPU profiles' figure (which
#    step 6's forward + backward gave, 2026-12-04).
# A failed step is reported and the next one runs; the exit status is 1 when any failed.
# zplan's own dependencies must be importable: where they are missing and pip cannot reach an index,
# put their wheels in .whl/ (pydantic, pydantic-core, annotated-types, ortools, ...): they are installed
# into a temporary folder first.
#
# zplan is installed into a temporary folder and every command runs from another (WORK): run from the repository's
# root, Python would import its zplan/ folder (the CLI alone) before the installed package (zplan.cuda, ...).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
LOG_DIR=$(mkdir -p "${LOG_DIR:-$REPO/out/gpu-logs}" && cd "${LOG_DIR:-$REPO/out/gpu-logs}" && pwd)
SITE=$(mktemp -d)
WORK=$(mktemp -d)
trap 'rm -rf "$SITE" "$WORK"' EXIT
cd "$REPO"

"$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())' || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.total --format=csv,noheader || true
if [ -d .whl ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || exit 1
fi
"$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . || exit 1
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$WORK"
# the tests' files imported by package name from REPO, after the installed zplan (pyproject's pythonpath, emptied
# here, would put REPO first)
PYTEST=("$PYTHON" -m pytest -q -m gpu -p no:cacheprovider -o pythonpath= --import-mode=append --rootdir "$REPO"
        -c "$REPO/pyproject.toml" -rs)

failed=()
# step NAME SECONDS COMMAND...: runs COMMAND under a time limit, its output on the terminal and in LOG_DIR/NAME.log
step() {
    local name=$1 limit=$2 began=$(date +%s)
    shift 2
    echo "== $name"
    if timeout "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"; then
        echo "-- $name: ok in $(( $(date +%s) - began )) s"
    else
        echo "-- $name: FAILED (exit ${PIPESTATUS[0]}) after $(( $(date +%s) - began )) s"
        failed+=("$name")
    fi
}

start=$(date +%s)
build_pids=()
for kernel in weight_only_matmul fused_norm_rope comm_quant weight_quant; do
    "$PYTHON" -c "import time; from zplan.cuda import $kernel as k; t = time.time(); k.load_cuda(strict=True); print('$kernel built in %.0f s' % (time.time() - t))" \
        > "$LOG_DIR/build-$kernel.log" 2>&1 &
    build_pids+=($!)
done
step nccl-runs 240 "${PYTEST[@]}" "$REPO/tests/gpu/test_nccl_runs.py"
for pid in "${build_pids[@]}"; do wait "$pid" || failed+=("build (pid $pid)"); done
cat "$LOG_DIR"/build-*.log
step kernel-tests 180 "${PYTEST[@]}" "$REPO/tests/gpu" --ignore "$REPO/tests/gpu/test_nccl_runs.py"
step kernel-benchmarks 90 "$PYTHON" "$REPO/benchmarks/gpu_kernels.py" --json
step measured-vs-predicted 240 "$PYTHON" "$REPO/benchmarks/gpu_measured_vs_predicted.py" --json
step step-breakdown 120 bash -c "'$PYTHON' '$REPO/benchmarks/gpu_step_breakdown.py' --seq 4096 \
    && '$PYTHON' '$REPO/benchmarks/gpu_step_breakdown.py' --seq 16384"
step tiny 90 bash -c "'$PYTHON' -m zplan compile '$REPO/examples/tiny.py' --gpus 1 --cluster dgx-h200 -o tiny \
    && '$PYTHON' tiny/train.py --steps 30 --log-json tiny/log.jsonl && tail -n 1 tiny/log.jsonl"
step host-overhead 60 "$PYTHON" "$REPO/benchmarks/gpu_host_overhead.py"
echo "gpu_check: done in $(( $(date +%s) - start )) s; failed: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
