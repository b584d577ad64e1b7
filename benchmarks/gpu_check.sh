#!/usr/bin/env bash
# Every GPU test and benchmark of the project, on a machine with CUDA; under 8 minutes on one GPU.
#
#     bash benchmarks/gpu_check.sh            # PYTHON=python3 by default: a Python that has torch with CUDA
#
# 1. tests marked gpu (tests/gpu): the emitted train.py with NCCL against one process on one GPU; plans
#    needing more GPUs than the machine has are skipped and say so.
# 2. examples/tiny.py compiled for one GPU of dgx-h200 and trained 30 steps from its emitted script: the
#    log shows measured tokens/s and MFU next to the plan's prediction.
# zplan's own dependencies must be importable: where they are missing and pip cannot reach an index,
# put their wheels in .whl/ (pydantic, pydantic-core, annotated-types, ortools, ...): they are installed
# into a temporary folder first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SITE=$(mktemp -d)
trap 'rm -rf "$SITE" out/gpu-check' EXIT

"$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print("torch", torch.__version__, torch.cuda.get_device_name())'
if [ -d .whl ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
fi
"$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" .
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

start=$(date +%s)
echo "== tests marked gpu"
"$PYTHON" -m pytest -q -m gpu -p no:cacheprovider -rs tests/gpu -s

echo "== examples/tiny.py on one GPU: measured against predicted"
"$PYTHON" -m zplan compile examples/tiny.py --gpus 1 --cluster dgx-h200 -o out/gpu-check
"$PYTHON" out/gpu-check/train.py --steps 30 --log-json out/gpu-check/log.jsonl
tail -n 1 out/gpu-check/log.jsonl
echo "gpu_check: done in $(( $(date +%s) - start )) s"
