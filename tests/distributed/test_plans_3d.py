"""Plans that combine tensor and pipeline parallelism, and a checkpoint resharded into one of them.

- tp=2 x pp=2 (1F1B, 4 processes) and dp=2 x tp=2 x pp=2 (8 processes, ZeRO-3 over dp): the emitted
  train.py against plain torch training the same model on the same global batch in one process: the
  loss of every step and the final parameters within 1e-5.
- A checkpoint written by ZeRO-3 on dp=2 after step 2 resumes under tp=2 x pp=2: steps 3 and 4 see the
  losses the ZeRO-3 run saw, and the final weights equal its final weights (so the Adam moments were
  resharded from dp shards into tp shards of pipeline stages too); one written by ZeRO-1 on dp=2 x tp=2
  (moments sharded over both) resumes under ZeRO-3 on dp=2 alike.
The model is test_tensor_parallel's tiny GPT (grouped-query attention, SwiGLU, tied head, biases).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import (
    Ranks,
    emit,
    import_file,
    max_loss_diff,
    max_weight_diff,
    read_log,
    run_emitted_script,
    train_args,
    train_single_process,
)
from tests.distributed.test_tensor_parallel import GLOBAL_BATCH, LAYERS, SEQ_LEN, TINY_TP_GPT, VOCAB, make_plan
from tests.plan_samples import gpt_unit_names
from zplan.schemas import Plan, Stage

pytestmark = pytest.mark.slow

STEPS = 4
SEED = 11
LR = 3e-3


def pipelined_plan(model_path: Path, *, tp: int, pp: int, dp: int, zero_stage: int,
                   vocab_parallel: bool = False) -> Plan:
    """make_plan's tp x dp plan cut into `pp` 1F1B stages at block boundaries (wte, wpe, blocks.0 | blocks.1,
    ln_f, head for pp=2), 2 micro-batches per step."""
    assert pp == 2, "the tiny GPT has 2 blocks: one cut"
    base = make_plan(model_path, tp=tp, dp=dp, zero_stage=zero_stage, sequence_parallel=False,
                     vocab_parallel=vocab_parallel)
    units = gpt_unit_names(LAYERS)  # wte, wpe, blocks.0, blocks.1, ln_f, head
    groups = [units[:3], units[3:]]
    stages = [Stage(index=0, first_layer=0, last_layer=2, layer_names=groups[0], fwd_flops_per_sample=0.0, params=0),
              Stage(index=1, first_layer=3, last_layer=len(units) - 1, layer_names=groups[1],
                    fwd_flops_per_sample=0.0, params=0)]
    parallel = base.parallel.model_copy(update=dict(pp=pp, schedule="1f1b", interleave=1))
    fingerprint = base.fingerprint.model_copy(update=dict(world_size=tp * pp * dp))
    return base.model_copy(update=dict(parallel=parallel, stages=stages, fingerprint=fingerprint))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny_tp_gpt.py"
    path.write_text(TINY_TP_GPT)
    return path


@pytest.fixture(scope="module")
def reference(model_path):
    build_model = import_file(model_path, "tiny_tp_gpt_3d_reference").build_model
    return train_single_process(build_model, steps=STEPS, seed=SEED, lr=LR, global_batch=GLOBAL_BATCH, vocab=VOCAB,
                                seq_len=SEQ_LEN)


@pytest.mark.parametrize("tp, pp, dp, zero_stage, vocab_parallel",
                         [(2, 2, 1, 0, False), (2, 2, 2, 3, False), (2, 2, 1, 0, True), (2, 2, 2, 3, True)],
                         ids=["tp2xpp2", "dp2xtp2xpp2-zero3", "tp2xpp2-vocab", "dp2xtp2xpp2-zero3-vocab"])
def test_tensor_and_pipeline_parallel_match_single_process(tp, pp, dp, zero_stage, vocab_parallel, model_path,
                                                           reference, tmp_path):
    """vocab_parallel: the tied table split by vocabulary rows over tp on the first stage and its copy on the last,
    whose gradients the pipeline sums over the two ranks (runtime/parallel/pipeline.py)."""
    plan = pipelined_plan(model_path, tp=tp, pp=pp, dp=dp, zero_stage=zero_stage, vocab_parallel=vocab_parallel)
    records, weights = run_emitted_script(plan, model_path, tmp_path / "out", steps=STEPS, seed=SEED, lr=LR)
    ref_losses, ref_weights = reference
    loss_diff = max_loss_diff([r["loss"] for r in records], ref_losses)
    weight_diff = max_weight_diff(weights, ref_weights)
    print(f"dp={dp} x tp={tp} x pp={pp} ZeRO {zero_stage}: max |loss - single process| = {loss_diff:.2e}, "
          f"max |parameter - single process| = {weight_diff:.2e}")
    assert ref_losses[-1] < ref_losses[0]  # it trains
    assert loss_diff <= 1e-5, ([r["loss"] for r in records], ref_losses)
    assert weight_diff <= 1e-5


def _resume_from_step_2(saved: Plan, resumed: Plan, model_path: Path, tmp_path: Path) -> tuple[float, float]:
    """Train `saved` for STEPS steps, checkpointing after step 2; resume that checkpoint under `resumed` for
    steps 3 and 4. Returns (max loss diff over steps 3-4, max final weight diff) between the two runs."""
    first = emit(saved, model_path, tmp_path / "saved")
    ckpt, log, weights = tmp_path / "ckpt", tmp_path / "saved.jsonl", tmp_path / "saved.pt"
    Ranks([str(first), *train_args(STEPS, SEED, LR, log), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
           "--save-weights", str(weights)], saved.fingerprint.world_size, tmp_path / "logs").wait_ok()

    second = emit(resumed, model_path, tmp_path / "resumed")
    resumed_log, resumed_weights = tmp_path / "resumed.jsonl", tmp_path / "resumed.pt"
    output = Ranks([str(second), *train_args(STEPS, SEED, LR, resumed_log), "--resume", str(ckpt / "step-000002"),
                    "--save-weights", str(resumed_weights)], resumed.fingerprint.world_size,
                   tmp_path / "logs").wait_ok()
    assert "resumed from" in output

    ref = {r["step"]: r["loss"] for r in read_log(log)}
    got = {r["step"]: r["loss"] for r in read_log(resumed_log)}
    assert sorted(got) == [3, 4]
    loss_diff = max(abs(got[s] - ref[s]) for s in got)
    return loss_diff, max_weight_diff(torch.load(resumed_weights), torch.load(weights))


def test_zero3_checkpoint_resumes_under_tensor_and_pipeline_parallel(model_path, tmp_path):
    """...and with the vocabulary split over tp: a checkpoint means the same tables whatever the layout."""
    loss_diff, weight_diff = _resume_from_step_2(
        make_plan(model_path, tp=1, dp=2, zero_stage=3, sequence_parallel=False),
        pipelined_plan(model_path, tp=2, pp=2, dp=1, zero_stage=0, vocab_parallel=True), model_path, tmp_path)
    print(f"ZeRO-3 dp=2 step 2 -> tp=2 x pp=2: max loss diff over steps 3-4 {loss_diff:.2e}, "
          f"final max |weight diff| {weight_diff:.2e}")
    assert loss_diff <= 1e-5 and weight_diff <= 1e-5


def test_zero1_tensor_parallel_checkpoint_resumes_under_zero3(model_path, tmp_path):
    """ZeRO-1 over dp=2 x tp=2 keeps Adam moments as (dp, tp) DTensors, _StridedShard over dp for the
    colwise (dim-0 split) parameters (runtime.optim.layouts): DCP must reassemble them into ZeRO-3's dp=2 shards;
    the token table split by vocabulary rows is read back whole."""
    loss_diff, weight_diff = _resume_from_step_2(
        make_plan(model_path, tp=2, dp=2, zero_stage=1, sequence_parallel=False, vocab_parallel=True),
        make_plan(model_path, tp=1, dp=2, zero_stage=3, sequence_parallel=False), model_path, tmp_path)
    print(f"ZeRO-1 dp=2 x tp=2 step 2 -> ZeRO-3 dp=2: max loss diff over steps 3-4 {loss_diff:.2e}, "
          f"final max |weight diff| {weight_diff:.2e}")
    assert loss_diff <= 1e-5 and weight_diff <= 1e-5
