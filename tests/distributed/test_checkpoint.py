"""Checkpoints of the emitted train.py (2 processes, gloo, fp32 unless a test says bf16): kill and resume, kill while
writing, resume under another plan (bf16 too: fp32 master weights), and `zplan export`.

The references are runs of the same script that were not interrupted: a resumed run must end with
bit-identical weights (dropout on, so the RNG state must come back too, and ZeRO-1, so the sharded
optimizer's partitions must), and a run resumed under another plan must see the losses that the
original run saw after the checkpoint. Kills are SIGKILLs at points the test chooses: the runtime's
test hook (ZPLAN_TEST_PAUSE) makes the processes sleep there, and the test kills them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import Ranks, emit, max_weight_diff, mean_weight_diff, read_log, train_args
from tests.plan_samples import gpt_unit_names, runnable_plan
from zplan.runtime.checkpoint.save import TEST_PAUSE_ENV
from zplan.schemas import Plan

pytestmark = pytest.mark.slow

STEPS = 6  # the kill tests: checkpoints after steps 2, 4 and 6, the last 2 kept
RESHARD_STEPS = 4  # the resharding tests: a checkpoint after step 2, compared on steps 3 and 4
SEED = 7
LR = 3e-3
GLOBAL_BATCH = 8  # sequences per step: dp * micro_batch * num_micro_batches in every plan
MICRO_BATCH = 2
VOCAB, SEQ_LEN, HIDDEN, HEADS, LAYERS = 64, 16, 32, 4, 2

# A GPT with tied embeddings and dropout (its rate from the environment, so that one file serves runs
# with and without it: the plan checks the file's hash), whose logits turn NaN at the forward call the environment
# names (TINY_GPT_NAN_AT_CALL, 1-based, per process; unset: never).
TINY_GPT = f'''
import os
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ_LEN, HIDDEN, HEADS, LAYERS = {VOCAB}, {SEQ_LEN}, {HIDDEN}, {HEADS}, {LAYERS}
DROPOUT = float(os.environ.get("TINY_GPT_DROPOUT", "0"))
NAN_AT_CALL = int(os.environ.get("TINY_GPT_NAN_AT_CALL", "0"))
CALLS = [0]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x):  # (B, T, h)
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)  # (B, a, T, d) each
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ_LEN, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):  # (B, T) -> (B, T, V)
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        CALLS[0] += 1
        logits = self.head(self.ln_f(x))
        return logits * float("nan") if CALLS[0] == NAN_AT_CALL else logits


def build_model():
    return TinyGPT()
'''


def make_plan(model_path: Path, *, zero_stage: int, dp: int, precision: str = "fp32") -> Plan:
    """A hand-made data-parallel plan for the tiny GPT."""
    return runnable_plan(model_path, units=gpt_unit_names(LAYERS), hidden=HIDDEN, heads=HEADS, vocab=VOCAB,
                         seq_len=SEQ_LEN, micro_batch=MICRO_BATCH, num_micro_batches=GLOBAL_BATCH // (dp * MICRO_BATCH),
                         dp=dp, zero_stage=zero_stage, precision=precision)


def with_offload(plan: Plan, offload: str, parameters: str = "gpu") -> Plan:
    """`plan` with its states offloaded to `offload` ('none', 'cpu', 'nvme'), the parameters on `parameters`."""
    return plan.model_copy(update=dict(parallel=plan.parallel.model_copy(update=dict(offload=offload)),
                                       placement=plan.placement.model_copy(update=dict(parameters=parameters))))


def launch(script: Path, args: list[str], world: int, *, dropout: float, pause: str | None = None,
           nan_at_call: int | None = None) -> Ranks:
    """`script` on `world` processes (logs beside it), dropout at `dropout`, paused where `pause` says, the logits
    NaN at forward call `nan_at_call` of each process."""
    return Ranks([str(script), *args], world, script.parent / "logs",
                 env={"TINY_GPT_DROPOUT": str(dropout), TEST_PAUSE_ENV: pause,
                      "TINY_GPT_NAN_AT_CALL": str(nan_at_call) if nan_at_call else None})


def losses_by_step(log: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in read_log(log)}


def checkpoint_names(directory: Path) -> list[str]:
    """The folder's entries but the run lock's file (runtime/checkpoint/run_lock.py), which stays for the next run."""
    return sorted(path.name for path in directory.iterdir() if path.name != ".zplan-run.lock")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny_gpt.py"
    path.write_text(TINY_GPT)
    return path


def _common_args(steps: int, log: Path) -> list[str]:
    return train_args(steps, SEED, LR, log)


# ---- kill and resume: ZeRO-1 (sharded optimizer) with dropout ------------------------------------


@pytest.fixture(scope="module")
def zero1_script(model_path, tmp_path_factory) -> Path:
    return emit(make_plan(model_path, zero_stage=1, dp=2), model_path, tmp_path_factory.mktemp("zero1") / "out")


def _checkpointing_args(ckpt: Path, log: Path, weights: Path) -> list[str]:
    return [*_common_args(STEPS, log), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--keep", "2",
            "--save-weights", str(weights), "--resume"]


@pytest.fixture(scope="module")
def uninterrupted(zero1_script, tmp_path_factory):
    """The reference: STEPS steps in one go, same flags (checkpointing included) as the killed runs."""
    work = tmp_path_factory.mktemp("uninterrupted")
    ckpt, log, weights = work / "ckpt", work / "log.jsonl", work / "weights.pt"
    launch(zero1_script, _checkpointing_args(ckpt, log, weights), 2, dropout=0.1).wait_ok()
    # Keep the last 2: step-000002 was deleted when step-000006 was complete.
    assert checkpoint_names(ckpt) == ["step-000004", "step-000006"]
    return losses_by_step(log), torch.load(weights)


def test_sigkill_mid_training_then_resume_is_identical(zero1_script, uninterrupted, tmp_path):
    ckpt, log, weights = tmp_path / "ckpt", tmp_path / "log.jsonl", tmp_path / "weights.pt"
    args = _checkpointing_args(ckpt, log, weights)
    # Killed after step 5: checkpoints 2 and 4 are on disk, step 5's work is lost.
    launch(zero1_script, args, 2, dropout=0.1, pause="after-step:5").kill_when_paused("paused at after-step:5")
    assert checkpoint_names(ckpt) == ["step-000002", "step-000004"]
    assert max(losses_by_step(log)) == 5 and not weights.exists()

    output = launch(zero1_script, args, 2, dropout=0.1).wait_ok()  # the same command line again
    assert f"resumed from {ckpt / 'step-000004'} (step 4 of {STEPS})" in output

    ref_losses, ref_weights = uninterrupted
    resumed_weights = torch.load(weights)
    diff = max_weight_diff(resumed_weights, ref_weights)
    print(f"SIGKILL after step 5, resumed from step 4: max |weight - uninterrupted| = {diff:.2e}")
    assert diff == 0.0
    assert losses_by_step(log) == ref_losses  # the log holds steps 1..6 once each, as uninterrupted
    assert checkpoint_names(ckpt) == ["step-000004", "step-000006"]


def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(zero1_script, uninterrupted, tmp_path):
    ckpt, log, weights = tmp_path / "ckpt", tmp_path / "log.jsonl", tmp_path / "weights.pt"
    args = _checkpointing_args(ckpt, log, weights)
    # Killed with step 4's checkpoint fully written and even marked complete, but not yet renamed.
    run = launch(zero1_script, args, 2, dropout=0.1, pause="before-rename:4")
    run.kill_when_paused("paused at before-rename:4")
    assert checkpoint_names(ckpt) == [".step-000004.tmp", "step-000002"]
    written = checkpoint_names(ckpt / ".step-000004.tmp")
    assert {".metadata", "COMPLETE", "train_state.json"} <= set(written)  # only the rename makes a checkpoint
    assert json.loads((ckpt / "step-000002" / "train_state.json").read_text())["step"] == 2

    output = launch(zero1_script, args, 2, dropout=0.1).wait_ok()
    assert f"resumed from {ckpt / 'step-000002'} (step 2 of {STEPS})" in output
    ref_losses, ref_weights = uninterrupted
    diff = max_weight_diff(torch.load(weights), ref_weights)
    print(f"SIGKILL before renaming step 4, resumed from step 2: max |weight - uninterrupted| = {diff:.2e}")
    assert diff == 0.0
    assert losses_by_step(log) == ref_losses
    assert checkpoint_names(ckpt) == ["step-000004", "step-000006"]  # the .tmp folder is gone


# ---- damaged, unverified and NaN: train.py's exit status, its flags, and the checkpoints it leaves -----------


def _flip_bytes(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def test_unverified_and_nan_states_are_never_trained_on_silently_nor_saved(zero1_script, tmp_path):
    """The reproduction: step 4's MANIFEST.json removed and 64 bytes of a shard flipped, then `--resume latest-valid
    --keep 2` loaded it without a word, trained on NaN, exited 0, saved the NaN states under fresh manifests and
    pruned the last good checkpoint. Now: plain --resume refuses it (exit status 2), latest-valid passes over it, a
    manifest-less checkpoint loads with --allow-unverified only and retention keeps the newest verified one, and a
    NaN loss stops the run with exit status 2 before saving (or, with --allow-nonfinite-loss, goes on saving
    nothing)."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"

    def args(steps: int, *more: str) -> list[str]:
        return [*_common_args(steps, log), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", *more]

    launch(zero1_script, args(4, "--keep", "3"), 2, dropout=0.0).wait_ok()
    (ckpt / "step-000004" / "MANIFEST.json").unlink()
    _flip_bytes(next((ckpt / "step-000004").glob("*.distcp")))

    refused = launch(zero1_script, args(6, "--keep", "2", "--resume"), 2, dropout=0.0)
    assert refused.wait() == 2, refused.output()[-4000:]
    assert f"{ckpt / 'step-000004'} has no MANIFEST.json" in refused.output() and "--allow-unverified" in \
        refused.output()
    output = launch(zero1_script, args(6, "--keep", "2", "--resume", "latest-valid"), 2, dropout=0.0).wait_ok()
    assert "passing over step-000004: " in output and f"resumed from {ckpt / 'step-000002'} (step 2 of 6)" in output
    assert checkpoint_names(ckpt) == ["step-000004", "step-000006"]  # step 4 written again, whole
    assert all(loss == loss for loss in losses_by_step(log).values())  # no NaN

    (ckpt / "step-000006" / "MANIFEST.json").unlink()  # unverified but sound: loads when told, marks what follows
    output = launch(zero1_script, args(8, "--keep", "2", "--resume", str(ckpt / "step-000006"), "--allow-unverified"),
                    2, dropout=0.0).wait_ok()
    assert "loaded without verifying it (--allow-unverified)" in output
    assert checkpoint_names(ckpt) == ["step-000004", "step-000006", "step-000008"]  # step 4: the newest verified
    assert json.loads((ckpt / "step-000008" / "train_state.json").read_text())["unverified_origin"] == \
        "step-000006 has no MANIFEST.json"

    nan_ckpt = tmp_path / "nan"
    # 2 micro-batches a step on each rank: forward call 5 is step 3's first
    nan_args = [*_common_args(4, log), "--checkpoint-dir", str(nan_ckpt), "--checkpoint-every", "1", "--keep", "5"]
    stopped = launch(zero1_script, nan_args, 2, dropout=0.0, nan_at_call=5)
    assert stopped.wait() == 2, stopped.output()[-4000:]
    assert (f"the loss of step 3 is nan (mean over the global batch): training stopped before saving that state; the "
            f"last checkpoint, {nan_ckpt / 'step-000002'}, was not overwritten") in stopped.output()
    assert checkpoint_names(nan_ckpt) == ["step-000001", "step-000002"]
    # resumed from step 2: forward call 1 is step 3's first
    going_on = launch(zero1_script, [*nan_args, "--allow-nonfinite-loss", "--resume"], 2, dropout=0.0, nan_at_call=1)
    assert "the loss of step 3 is nan (--allow-nonfinite-loss: going on)" in going_on.wait_ok()
    assert checkpoint_names(nan_ckpt) == ["step-000001", "step-000002"]  # steps 3 and 4: NaN weights, not saved


# ---- resharding: ZeRO-3 and ZeRO-1 dp=2 checkpoints resumed under other stages and dp sizes ----------


def _nvme_args(offload: str, work: Path) -> list[str]:
    return ["--nvme-path", str(work / "nvme")] if offload == "nvme" else []


def _reshard_source(model_path: Path, work: Path, zero_stage: int, offload: str = "none", parameters: str = "gpu"):
    """`zero_stage` on 2 processes, RESHARD_STEPS steps, a checkpoint after every 2 (kept), final weights."""
    plan = with_offload(make_plan(model_path, zero_stage=zero_stage, dp=2), offload, parameters)
    script = emit(plan, model_path, work / "out")
    ckpt, log, weights = work / "ckpt", work / "log.jsonl", work / "weights.pt"
    launch(script, [*_common_args(RESHARD_STEPS, log), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                    "--save-weights", str(weights), *_nvme_args(offload, work)], 2, dropout=0.0).wait_ok()
    assert checkpoint_names(ckpt) == ["step-000002", "step-000004"]
    return ckpt, losses_by_step(log), torch.load(weights)


@pytest.fixture(scope="module")
def zero3_run(model_path, tmp_path_factory):
    return _reshard_source(model_path, tmp_path_factory.mktemp("zero3"), zero_stage=3)


@pytest.fixture(scope="module")
def zero1_run(model_path, tmp_path_factory):
    return _reshard_source(model_path, tmp_path_factory.mktemp("zero1-reshard"), zero_stage=1)


def _resume_under(source, source_name: str, zero_stage: int, dp: int, model_path: Path, tmp_path: Path,
                  offload: str = "none", parameters: str = "gpu") -> None:
    """Resume `source`'s step-2 checkpoint under ZeRO `zero_stage` on `dp` processes (states offloaded to
    `offload`): steps 3 and 4 and the final weights must be those of the uninterrupted source run."""
    ckpt, ref_losses, ref_weights = source
    plan = with_offload(make_plan(model_path, zero_stage=zero_stage, dp=dp), offload, parameters)
    script = emit(plan, model_path, tmp_path / "out")
    log, weights = tmp_path / "log.jsonl", tmp_path / "weights.pt"
    output = launch(script, [*_common_args(RESHARD_STEPS, log), "--resume", str(ckpt / "step-000002"),
                             "--save-weights", str(weights), *_nvme_args(offload, tmp_path)], dp,
                    dropout=0.0).wait_ok()
    assert "resumed from" in output
    losses = losses_by_step(log)
    assert sorted(losses) == [3, 4]
    next_step_diff = abs(losses[3] - ref_losses[3])
    later_diff = max(abs(losses[s] - ref_losses[s]) for s in (3, 4))
    weight_diff = max_weight_diff(torch.load(weights), ref_weights)
    print(f"{source_name} dp=2 step 2 -> ZeRO-{zero_stage} dp={dp}: next-step loss diff {next_step_diff:.2e}, "
          f"max loss diff over steps 3-4 {later_diff:.2e}, final max |weight diff| {weight_diff:.2e}")
    assert next_step_diff <= 1e-5
    # Step 4's loss and the final weights depend on the Adam moments: the optimizer state resharded
    # too (moments lost or misplaced would move weights by ~LR = 3e-3).
    assert later_diff <= 1e-5 and weight_diff <= 1e-5


@pytest.mark.parametrize("zero_stage, dp", [(0, 2), (0, 1), (1, 2)])
def test_zero3_checkpoint_resumes_under_another_plan(zero_stage, dp, zero3_run, model_path, tmp_path):
    _resume_under(zero3_run, "ZeRO-3", zero_stage, dp, model_path, tmp_path)


@pytest.mark.parametrize("zero_stage, dp", [(3, 2), (0, 1)])
def test_zero1_checkpoint_resumes_under_another_plan(zero_stage, dp, zero1_run, model_path, tmp_path):
    """ZeRO-1's moments are dim-0 shards (runtime.optim.layouts): read whole by one process, as FSDP2 shards by
    ZeRO-3."""
    _resume_under(zero1_run, "ZeRO-1", zero_stage, dp, model_path, tmp_path)


@pytest.mark.parametrize("zero_stage, offload, parameters", [(1, "cpu", "gpu"), (2, "cpu", "gpu"), (1, "nvme", "gpu"),
                                                            (3, "nvme", "nvme")])
def test_checkpoint_resumes_into_offloaded_states(zero_stage, offload, parameters, zero3_run, model_path, tmp_path):
    """A ZeRO-3 checkpoint into ZeRO-Offload's host states (ZeRO-1's rows; ZeRO-2's shards with the optimizer alone
    on the host, runtime.optim.host_states) and ZeRO-Infinity's files (load_state_dict)."""
    _resume_under(zero3_run, "ZeRO-3", zero_stage, 2, model_path, tmp_path, offload, parameters)


@pytest.fixture(scope="module")
def zero3_nvme_run(model_path, tmp_path_factory):
    return _reshard_source(model_path, tmp_path_factory.mktemp("zero3-nvme"), zero_stage=3, offload="nvme",
                           parameters="nvme")


@pytest.fixture(scope="module")
def zero3_cpu_optimizer_run(model_path, tmp_path_factory):
    return _reshard_source(model_path, tmp_path_factory.mktemp("zero3-cpu-optimizer"), zero_stage=3, offload="cpu",
                           parameters="gpu")


def test_cpu_offloaded_optimizer_checkpoint_resumes_under_another_plan(zero3_cpu_optimizer_run, model_path, tmp_path):
    """ZeRO-3 with the optimizer alone on the host (runtime.optim.host_states): its host moments saved as
    FSDP2-layout DTensors (state_dict), resumed without offload under ZeRO-1."""
    _resume_under(zero3_cpu_optimizer_run, "ZeRO-3, optimizer on the CPU", 1, 2, model_path, tmp_path)


def test_nvme_offloaded_checkpoint_resumes_under_another_plan(zero3_nvme_run, model_path, tmp_path):
    """Moments and parameter shards read back from their swap files into a checkpoint (state_dict), resumed
    without offload under ZeRO-1."""
    _resume_under(zero3_nvme_run, "ZeRO-3 on NVMe", 1, 2, model_path, tmp_path)


# ---- mixed precision: a ZeRO-1 bf16 checkpoint (fp32 masters) resumed under ZeRO-3 bf16 and back ----------


def _checkpoint_dtypes(checkpoint: Path) -> dict[str, torch.dtype]:
    """{DCP key ('model.<fqn>', 'optimizer.state.<fqn>.exp_avg', ...): dtype} of the checkpoint's tensors, from its
    .metadata alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from zplan.runtime.checkpoint.save import SafeFileSystemReader

    metadata = SafeFileSystemReader(checkpoint).read_metadata()
    return {key: entry.properties.dtype for key, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)}


def _bf16_run(model_path: Path, work: Path, zero_stage: int, *, resume: Path | None = None
              ) -> tuple[Path, dict[int, float], dict[str, torch.Tensor]]:
    """ZeRO `zero_stage` bf16 on 2 processes to step RESHARD_STEPS (from `resume` when given), a checkpoint after
    every step, all kept; (checkpoint folder, {step: loss}, final weights)."""
    script = emit(make_plan(model_path, zero_stage=zero_stage, dp=2, precision="bf16"), model_path, work / "out")
    ckpt, log, weights = work / "ckpt", work / "log.jsonl", work / "weights.pt"
    args = [*_common_args(RESHARD_STEPS, log), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
            "--keep", str(RESHARD_STEPS), "--save-weights", str(weights)]
    args += ["--resume", str(resume)] if resume else []
    output = launch(script, args, 2, dropout=0.0).wait_ok()
    assert resume is None or f"resumed from {resume}" in output
    return ckpt, losses_by_step(log) if log.exists() else {}, torch.load(weights)  # no log: no step was left


def test_zero1_bf16_checkpoint_resumes_under_zero3_bf16_and_back(model_path, tmp_path):
    """ZeRO-1 bf16 (bf16 parameters and gradients, fp32 masters in its optimizer: runtime.optim.layouts) checkpoints the
    masters as the model's weights; ZeRO-3 bf16 (FSDP2's fp32 shards, bf16 compute) resumes from them after step 2,
    and ZeRO-1 bf16 from ZeRO-3's checkpoint after step 3: each resumed run's next loss is the one the run it
    resumed from saw, bit for bit, and the checkpoints hold fp32 masters, not the bf16 parameters."""
    from safetensors.torch import load_file

    from zplan.export import export_checkpoint

    zero1_ckpt, zero1_losses, zero1_weights = _bf16_run(model_path, tmp_path / "zero1", 1)
    zero3_ckpt, zero3_losses, zero3_weights = _bf16_run(model_path, tmp_path / "zero3", 3,
                                                        resume=zero1_ckpt / "step-000002")
    _, back_losses, back_weights = _bf16_run(model_path, tmp_path / "back", 1, resume=zero3_ckpt / "step-000003")
    assert sorted(zero1_losses) == [1, 2, 3, 4] and sorted(zero3_losses) == [3, 4] and sorted(back_losses) == [4]
    there, back = zero3_losses[3] - zero1_losses[3], back_losses[4] - zero3_losses[4]
    drift = zero3_losses[4] - zero1_losses[4]
    there_weights, back_weights_diff = mean_weight_diff(zero3_weights, zero1_weights), mean_weight_diff(
        back_weights, zero3_weights)
    print(f"bf16 ZeRO-1 step 2 -> ZeRO-3: step-3 loss diff {there:.2e}; ZeRO-3 step 3 -> ZeRO-1: step-4 loss diff "
          f"{back:.2e}; ZeRO-3's step 4 against ZeRO-1's {drift:.2e}; final mean |weight diff| ZeRO-3 vs ZeRO-1 "
          f"{there_weights:.2e}, back vs ZeRO-3 {back_weights_diff:.2e}")
    # Bit-equal: the step after a resume computes from the same fp32 masters, both stages round them to the same
    # bf16 parameters (ZeRO-1 holds them, FSDP2's MixedPrecisionPolicy casts its shards before the all-gather) and run
    # the same bf16 forward on the same micro-batches, per rank, the loss summed over the 2 ranks the same way.
    assert there == 0.0 and back == 0.0
    # Past that step the stages part by rounding: ZeRO-1 all-reduces bf16 gradients, FSDP2 reduce-scatters them in
    # fp32 (reduce_dtype). Measured: step 4 |diff| ~4e-5, mean |weight diff| 2e-6 (two steps) and 3e-7 (one); the
    # Adam moments lost at the resume instead would move step 4's loss by 5e-3 and the weights by 8e-4 on average
    # (a single-process bf16 run with its optimizer rebuilt at that step): so the moments were resharded too.
    assert abs(drift) <= 5e-4 and there_weights <= 2e-5 and back_weights_diff <= 2e-5

    # Every tensor of the checkpoints is fp32, the ZeRO-1 ones too (its parameters are bf16): weights and moments.
    for checkpoint in (zero1_ckpt / "step-000002", zero3_ckpt / "step-000003", zero1_ckpt / "step-000004"):
        dtypes = _checkpoint_dtypes(checkpoint)
        assert any(key.startswith("model.") for key in dtypes) and any(".exp_avg_sq" in key for key in dtypes)
        assert set(dtypes.values()) == {torch.float32}, (checkpoint, dtypes)
    # ...and the model's are the masters, not the bf16 parameters upcast: the weights ZeRO-1 saved at the end (its
    # masters) exactly, with no weight a bf16 value.
    exported = load_file(export_checkpoint(zero1_ckpt / "step-000004", tmp_path / "zero1.safetensors"))
    assert set(exported) == set(zero1_weights)
    for name, weight in exported.items():
        assert weight.dtype == torch.float32 and torch.equal(weight, zero1_weights[name]), name
        assert not torch.equal(weight, weight.bfloat16().float()), name
    # Loading fills ZeRO-1's masters with the checkpoint's fp32 weights exactly: resumed at its last step (no step
    # left to run), ZeRO-1 saves ZeRO-3's final weights bit for bit.
    _, no_losses, loaded_weights = _bf16_run(model_path, tmp_path / "loaded", 1, resume=zero3_ckpt / "step-000004")
    assert not no_losses and max_weight_diff(loaded_weights, zero3_weights) == 0.0


# ---- zplan export -----------------------------------------------------------------------------------


def test_export_writes_the_trained_full_state_dict(zero3_run, tmp_path):
    from safetensors.torch import load_file

    from zplan.errors import ZplanError
    from zplan.export import export_checkpoint

    ckpt, _, ref_weights = zero3_run  # the newest checkpoint is the one after the last step
    out = export_checkpoint(ckpt, tmp_path / "model.safetensors", max_chunk_bytes=16 * 1024)
    exported = load_file(out)
    assert set(exported) == set(ref_weights)
    for name, tensor in ref_weights.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    with pytest.raises(ZplanError, match="does not exist"):
        export_checkpoint(ckpt / "step-999999", tmp_path / "other.safetensors")
