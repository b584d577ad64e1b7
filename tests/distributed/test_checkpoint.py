"""Checkpoints of the emitted train.py (2 processes, gloo, fp32): kill and resume, kill while writing,
resume under another plan, and `zplan export`.

The references are runs of the same script that were not interrupted: a resumed run must end with
bit-identical weights (dropout on, so the RNG state must come back too, and ZeRO-1, so the sharded
optimizer's partitions must), and a run resumed under another plan must see the losses that the
original run saw after the checkpoint. Kills are SIGKILLs at points the test chooses: the runtime's
test hook (ZPLAN_TEST_PAUSE) makes the processes sleep there, and the test kills them.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zplan.codegen.script import render_script_files
from zplan.planner.cpu_local import CPU_LOCAL
from zplan.runtime.checkpoint import TEST_PAUSE_ENV
from zplan.schemas import (
    Fingerprint,
    LayerCost,
    MemoryBreakdown,
    ModelSummary,
    ParallelConfig,
    Pins,
    Placement,
    Plan,
    Prediction,
    Stage,
    TimeBreakdown,
    TrainSpec,
)

pytestmark = pytest.mark.slow

STEPS = 6  # the kill tests: checkpoints after steps 2, 4 and 6, the last 2 kept
RESHARD_STEPS = 4  # the resharding tests: a checkpoint after step 2, compared on steps 3 and 4
SEED = 7
LR = 3e-3
GLOBAL_BATCH = 8  # sequences per step: dp * micro_batch * num_micro_batches in every plan
MICRO_BATCH = 2
VOCAB, SEQ_LEN, HIDDEN, HEADS, LAYERS = 64, 16, 32, 4, 2
LAUNCH_TIMEOUT_S = 180

# A GPT with tied embeddings and dropout (its rate from the environment, so that one file serves runs
# with and without it: the plan checks the file's hash).
TINY_GPT = f'''
import os
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ_LEN, HIDDEN, HEADS, LAYERS = {VOCAB}, {SEQ_LEN}, {HIDDEN}, {HEADS}, {LAYERS}
DROPOUT = float(os.environ.get("TINY_GPT_DROPOUT", "0"))


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
        return self.head(self.ln_f(x))


def build_model():
    return TinyGPT()
'''

UNIT_NAMES = ["wte", "wpe", *(f"blocks.{i}" for i in range(LAYERS)), "ln_f", "head"]


def make_plan(model_path: Path, *, zero_stage: int, dp: int) -> Plan:
    """A hand-made data-parallel plan: the fields the runtime reads are real, predictions placeholders."""
    layers = [LayerCost(name=n, kind="block" if n.startswith("blocks") else "other", params=0, fwd_flops=0.0,
                        act_bytes=0.0) for n in UNIT_NAMES]
    return Plan(
        zplan_version="test",
        fingerprint=Fingerprint(model_ref=str(model_path), cluster=CPU_LOCAL.name, world_size=dp,
                                model_sha256=hashlib.sha256(model_path.read_bytes()).hexdigest()),
        model=ModelSummary(
            name="tiny-gpt", source="file", tracer="hand", num_blocks=LAYERS, hidden=HIDDEN, heads=HEADS,
            kv_heads=HEADS, ffn_hidden=4 * HIDDEN, vocab=VOCAB, seq_len=SEQ_LEN, params=1, layers=layers,
            block_prefix="blocks", tp_rules=[],
        ),
        cluster=CPU_LOCAL,
        train=TrainSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision="fp32"),
        pins=Pins(zero=zero_stage),
        parallel=ParallelConfig(
            tp=1, pp=1, dp=dp, micro_batch=MICRO_BATCH, num_micro_batches=GLOBAL_BATCH // (dp * MICRO_BATCH),
            zero_stage=zero_stage, recompute="none", sequence_parallel=False, interleave=1,
            schedule="none", offload="none",
        ),
        stages=[Stage(index=0, first_layer=0, last_layer=len(UNIT_NAMES) - 1, layer_names=UNIT_NAMES,
                      fwd_flops_per_sample=0.0, params=0)],
        placement=Placement(parameters="gpu", gradients="gpu", optimizer="gpu"),
        prediction=Prediction(step_time_s=0.01, tokens_per_s=1.0, mfu=0.01, model_flops_per_step=1e6,
                              memory=MemoryBreakdown(**{f: 0.0 for f in MemoryBreakdown.model_fields}),
                              time=TimeBreakdown(**{f: 0.0 for f in TimeBreakdown.model_fields}),
                              feasible=True),
        candidates_evaluated=1, alternatives=[], rejected=[], assumptions=[],
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """One launch of an emitted train.py on `world` processes with the environment torchrun gives
    them (without torchrun's own start-up); each rank's output goes to out_dir/rank-R.out."""

    def __init__(self, script: Path, args: list[str], world: int, *, dropout: float, pause: str | None = None):
        self.script, self.world = script, world
        self.outputs = [script.parent / f"rank-{rank}.{time.monotonic_ns()}.out" for rank in range(world)]
        port = str(_free_port())
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TINY_GPT_DROPOUT": str(dropout)}
        env.pop(TEST_PAUSE_ENV, None)
        if pause:
            env[TEST_PAUSE_ENV] = pause
        if world > 1:
            env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port)
        self.processes = []
        for rank, output in enumerate(self.outputs):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} if world > 1 else env
            with open(output, "w") as out:
                self.processes.append(subprocess.Popen([sys.executable, str(script), *args], stdout=out,
                                                       stderr=subprocess.STDOUT, env=rank_env))

    def output(self) -> str:
        return "\n".join(f"--- rank {rank}\n{path.read_text()}" for rank, path in enumerate(self.outputs))

    def wait(self) -> str:
        """Wait for a normal end; return every rank's output."""
        try:
            returncodes = [p.wait(timeout=LAUNCH_TIMEOUT_S) for p in self.processes]
        finally:
            self.kill()
        assert max(returncodes) == 0, self.output()[-8000:]
        return self.output()

    def kill_when_paused(self, text: str) -> None:
        """Wait until rank 0 printed `text` (it sleeps there), then SIGKILL every process."""
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while text not in self.outputs[0].read_text():
            assert time.monotonic() < deadline, "never paused:\n" + self.output()[-8000:]
            assert self.processes[0].poll() is None, "ended before pausing:\n" + self.output()[-8000:]
            time.sleep(0.1)
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            process.wait()


def emit(plan: Plan, model_path: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True)
    (out_dir / "plan.json").write_text(plan.model_dump_json(indent=2))
    render_script_files(plan, out_dir, os.path.relpath(model_path, out_dir))
    return out_dir / "train.py"


def losses_by_step(log: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in map(json.loads, log.read_text().splitlines())}


def max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def checkpoint_names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny_gpt.py"
    path.write_text(TINY_GPT)
    return path


def _common_args(steps: int, log: Path) -> list[str]:
    return ["--steps", str(steps), "--seed", str(SEED), "--lr", str(LR), "--log-json", str(log)]


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
    Run(zero1_script, _checkpointing_args(ckpt, log, weights), 2, dropout=0.1).wait()
    # Keep the last 2: step-000002 was deleted when step-000006 was complete.
    assert checkpoint_names(ckpt) == ["step-000004", "step-000006"]
    return losses_by_step(log), torch.load(weights)


def test_sigkill_mid_training_then_resume_is_identical(zero1_script, uninterrupted, tmp_path):
    ckpt, log, weights = tmp_path / "ckpt", tmp_path / "log.jsonl", tmp_path / "weights.pt"
    args = _checkpointing_args(ckpt, log, weights)
    # Killed after step 5: checkpoints 2 and 4 are on disk, step 5's work is lost.
    Run(zero1_script, args, 2, dropout=0.1, pause="after-step:5").kill_when_paused("paused at after-step:5")
    assert checkpoint_names(ckpt) == ["step-000002", "step-000004"]
    assert max(losses_by_step(log)) == 5 and not weights.exists()

    output = Run(zero1_script, args, 2, dropout=0.1).wait()  # the same command line again
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
    run = Run(zero1_script, args, 2, dropout=0.1, pause="before-rename:4")
    run.kill_when_paused("paused at before-rename:4")
    assert checkpoint_names(ckpt) == [".step-000004.tmp", "step-000002"]
    written = checkpoint_names(ckpt / ".step-000004.tmp")
    assert {".metadata", "COMPLETE", "train_state.json"} <= set(written)  # only the rename makes a checkpoint
    assert json.loads((ckpt / "step-000002" / "train_state.json").read_text())["step"] == 2

    output = Run(zero1_script, args, 2, dropout=0.1).wait()
    assert f"resumed from {ckpt / 'step-000002'} (step 2 of {STEPS})" in output
    ref_losses, ref_weights = uninterrupted
    diff = max_weight_diff(torch.load(weights), ref_weights)
    print(f"SIGKILL before renaming step 4, resumed from step 2: max |weight - uninterrupted| = {diff:.2e}")
    assert diff == 0.0
    assert losses_by_step(log) == ref_losses
    assert checkpoint_names(ckpt) == ["step-000004", "step-000006"]  # the .tmp folder is gone


# ---- resharding: a ZeRO-3 dp=2 checkpoint resumed under ZeRO-0 dp=2 and on one process -----------


@pytest.fixture(scope="module")
def zero3_run(model_path, tmp_path_factory):
    """ZeRO-3 on 2 processes, RESHARD_STEPS steps, a checkpoint after every 2 (kept), final weights."""
    work = tmp_path_factory.mktemp("zero3")
    script = emit(make_plan(model_path, zero_stage=3, dp=2), model_path, work / "out")
    ckpt, log, weights = work / "ckpt", work / "log.jsonl", work / "weights.pt"
    Run(script, [*_common_args(RESHARD_STEPS, log), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                 "--save-weights", str(weights)], 2, dropout=0.0).wait()
    assert checkpoint_names(ckpt) == ["step-000002", "step-000004"]
    return ckpt, losses_by_step(log), torch.load(weights)


@pytest.mark.parametrize("zero_stage, dp", [(0, 2), (0, 1)])
def test_zero3_checkpoint_resumes_under_another_plan(zero_stage, dp, zero3_run, model_path, tmp_path):
    ckpt, ref_losses, ref_weights = zero3_run
    script = emit(make_plan(model_path, zero_stage=zero_stage, dp=dp), model_path, tmp_path / "out")
    log, weights = tmp_path / "log.jsonl", tmp_path / "weights.pt"
    output = Run(script, [*_common_args(RESHARD_STEPS, log), "--resume", str(ckpt / "step-000002"),
                          "--save-weights", str(weights)], dp, dropout=0.0).wait()
    assert "resumed from" in output
    losses = losses_by_step(log)
    assert sorted(losses) == [3, 4]
    next_step_diff = abs(losses[3] - ref_losses[3])
    later_diff = max(abs(losses[s] - ref_losses[s]) for s in (3, 4))
    weight_diff = max_weight_diff(torch.load(weights), ref_weights)
    print(f"ZeRO-3 dp=2 step 2 -> ZeRO-{zero_stage} dp={dp}: next-step loss diff {next_step_diff:.2e}, "
          f"max loss diff over steps 3-4 {later_diff:.2e}, final max |weight diff| {weight_diff:.2e}")
    assert next_step_diff <= 1e-5
    # Step 4's loss and the final weights depend on the Adam moments: the optimizer state resharded
    # too (moments lost or misplaced would move weights by ~LR = 3e-3).
    assert later_diff <= 1e-5 and weight_diff <= 1e-5


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
