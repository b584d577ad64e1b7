"""The emitted train.py on GPUs with NCCL against one process on one GPU (marked gpu; skipped without CUDA).

The same comparisons as tests/distributed on CPU with gloo: for each plan (ZeRO 0-3 over dp=2, tp=2, pp=2,
tp x pp, dp x tp x pp, and a world of one) the loss of every step and the final parameters must equal plain
torch training the same model on the same global batch on one GPU, within 1e-5 (fp32; TF32 is off by
torch's default for matmuls). A plan runs only when the machine has a GPU per rank (one H200 runs the
world-of-one cases); bf16 is checked for training and for fp32 master weights. `benchmarks/gpu_check.sh`
runs this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import (
    import_file,
    max_loss_diff,
    max_weight_diff,
    run_emitted_script,
    train_single_process,
)
from tests.distributed.test_plans_3d import pipelined_plan
from tests.distributed.test_tensor_parallel import GLOBAL_BATCH, SEQ_LEN, TINY_TP_GPT, VOCAB, make_plan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 4
SEED = 13
LR = 3e-3
# The tests' tiny GPT with its position ids made on the input's device (the CPU tests' file makes them
# on the CPU).
TINY_GPU_GPT = TINY_TP_GPT.replace("torch.arange(idx.size(1))", "torch.arange(idx.size(1), device=idx.device)")

PLANS = {  # name: (tp, pp, dp, ZeRO stage); world = tp * pp * dp
    "one-gpu": (1, 1, 1, 0),
    "one-gpu-zero3": (1, 1, 1, 3),
    "dp2-zero0": (1, 1, 2, 0),
    "dp2-zero1": (1, 1, 2, 1),
    "dp2-zero2": (1, 1, 2, 2),
    "dp2-zero3": (1, 1, 2, 3),
    "tp2": (2, 1, 1, 0),
    "pp2": (1, 2, 1, 0),
    "dp2xtp2-zero3": (2, 1, 2, 3),
    "tp2xpp2": (2, 2, 1, 0),
    "dp2xtp2xpp2-zero3": (2, 2, 2, 3),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny_gpu_gpt.py"
    path.write_text(TINY_GPU_GPT)
    return path


@pytest.fixture(scope="module")
def reference(model_path):
    build_model = import_file(model_path, "tiny_gpu_gpt_reference").build_model
    return train_single_process(build_model, steps=STEPS, seed=SEED, lr=LR, global_batch=GLOBAL_BATCH, vocab=VOCAB,
                                seq_len=SEQ_LEN, device="cuda")


def _plan(model_path: Path, tp: int, pp: int, dp: int, zero_stage: int, precision: str = "fp32"):
    if pp > 1:
        plan = pipelined_plan(model_path, tp=tp, pp=pp, dp=dp, zero_stage=zero_stage)
    else:
        plan = make_plan(model_path, tp=tp, dp=dp, zero_stage=zero_stage, sequence_parallel=False)
    if precision != "fp32":
        plan = plan.model_copy(update=dict(train=plan.train.model_copy(update=dict(precision=precision))))
    return plan


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_on_gpus_matches_one_gpu(name, model_path, reference, tmp_path):
    tp, pp, dp, zero_stage = PLANS[name]
    if torch.cuda.device_count() < tp * pp * dp:
        pytest.skip(f"needs {tp * pp * dp} GPUs, this machine has {torch.cuda.device_count()}")
    plan = _plan(model_path, tp, pp, dp, zero_stage)
    records, weights = run_emitted_script(plan, model_path, tmp_path / "out", steps=STEPS, seed=SEED, lr=LR,
                                          device="cuda")
    ref_losses, ref_weights = reference
    loss_diff = max_loss_diff([r["loss"] for r in records], ref_losses)
    weight_diff = max_weight_diff(weights, ref_weights)
    print(f"{name} on NCCL: max |loss - one GPU| = {loss_diff:.2e}, max |parameter - one GPU| = {weight_diff:.2e}")
    assert ref_losses[-1] < ref_losses[0]
    assert loss_diff <= 1e-5 and weight_diff <= 1e-5


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_bf16_trains_with_fp32_master_weights(zero_stage, model_path, reference, tmp_path):
    plan = _plan(model_path, 1, 1, 1, zero_stage, precision="bf16")
    records, weights = run_emitted_script(plan, model_path, tmp_path / "out", steps=STEPS, seed=SEED, lr=LR,
                                          device="cuda")
    ref_losses, _ = reference
    losses = [r["loss"] for r in records]
    assert all(w.dtype == torch.float32 for w in weights.values())  # master weights stay fp32
    assert losses[-1] < losses[0]
    assert max_loss_diff(losses, ref_losses) <= 0.05  # bf16 compute: ~3 significant digits


OFFLOADS = {  # name: (ZeRO stage, offload, parameters' tier); one GPU, so every state is this rank's
    "zero1-cpu": (1, "cpu", "gpu"),
    "zero1-cpu-delayed": (1, "cpu", "gpu"),  # its first 40 steps are the exact warm-up
    "zero1-nvme": (1, "nvme", "gpu"),
    "zero2-cpu-optimizer": (2, "cpu", "gpu"),  # the shards on the GPU, the optimizer alone on the host
    "zero3-cpu-optimizer": (3, "cpu", "gpu"),
    "zero3-nvme-parameters": (3, "nvme", "nvme"),
}


@pytest.mark.parametrize("name", list(OFFLOADS))
def test_offload_on_one_gpu_matches_one_gpu(name, model_path, reference, tmp_path):
    """The CUDA paths of offload: pinned host states, gradient rows staged to the host, updated rows back
    (runtime.optim.host_states, nvme_states, param_swap), against plain training on
    the GPU."""
    zero_stage, offload, parameters = OFFLOADS[name]
    plan = _plan(model_path, 1, 1, 1, zero_stage)
    plan = plan.model_copy(update=dict(
        parallel=plan.parallel.model_copy(update=dict(offload=offload, delayed_update=name.endswith("delayed"))),
        placement=plan.placement.model_copy(update=dict(parameters=parameters))))
    extra = ("--nvme-path", str(tmp_path / "nvme")) if offload == "nvme" else ()
    records, weights = run_emitted_script(plan, model_path, tmp_path / "out", steps=STEPS, seed=SEED, lr=LR,
                                          device="cuda", extra_args=extra)
    ref_losses, ref_weights = reference
    loss_diff = max_loss_diff([r["loss"] for r in records], ref_losses)
    weight_diff = max_weight_diff(weights, ref_weights)
    print(f"{name}: max |loss - one GPU| = {loss_diff:.2e}, max |parameter - one GPU| = {weight_diff:.2e}, "
          f"bytes per tier {records[0]['state_bytes_by_tier']}")
    assert loss_diff <= 1e-5 and weight_diff <= 1e-5
    assert records[0]["state_bytes_by_tier"]["host" if offload == "cpu" else "nvme"] > 0  # states left the GPU
