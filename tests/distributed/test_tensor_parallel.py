"""Tensor parallel (tp=2) and dp x tp (2 x 2), with and without sequence parallel, against one process.

Two references, both independent of the runtime's parallel code:
- the emitted train.py (a hand-made Plan, rendered and launched like torchrun) against plain torch
  training the same model on the same global batch in this process: the loss of every step and the
  final (gathered) parameters must agree within 1e-5;
- the repository's examples (tiny.py, gpt.py and llama.py with grouped-query attention, small sizes)
  under tp=2: logits and every parameter's gradient against the same model unsplit, on each rank
  (this file is also the worker script of that check: `python test_tensor_parallel.py examples`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import multiprocessing
import os
import runpy
import socket
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from zplan.codegen.script import render_script_files
from zplan.planner.cpu_local import CPU_LOCAL
from zplan.runtime.data import synthetic_token_batch
from zplan.runtime.train_loop import WarmupCosine
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
    TensorParallelRule,
    TimeBreakdown,
    TrainSpec,
)

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
SEED = 5
LR = 1e-3  # the script's --lr; weight decay 0.1 and clipping at 1.0 are train.py's defaults
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
GLOBAL_BATCH = 4  # sequences per step in every configuration: dp * micro_batch * num_micro_batches
VOCAB, SEQ_LEN, HIDDEN, HEADS, KV_HEADS, LAYERS = 64, 16, 32, 4, 2, 2

# Grouped-query attention (4 query heads, 2 key/value heads: one per rank at tp=2), biases (the
# rowwise bias is added once, after the reduction), a SwiGLU MLP (two colwise Linears feeding one
# rowwise), a LayerNorm and an RMSNorm (both run token-wise under sequence parallel), a tied head and a
# nanoGPT-style scaled init.
TINY_TP_GPT = f'''
import math
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ_LEN, HIDDEN, HEADS, KV_HEADS, LAYERS = {VOCAB}, {SEQ_LEN}, {HIDDEN}, {HEADS}, {KV_HEADS}, {LAYERS}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.k = nn.Linear(HIDDEN, KV_HEADS * self.head_dim)
        self.v = nn.Linear(HIDDEN, KV_HEADS * self.head_dim)
        self.o = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):  # (B, T, h)
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, a, T, d)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, a_kv, T, d)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, a_kv, T, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, a, T, d)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.up = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.down = nn.Linear(3 * HIDDEN, HIDDEN)

    def forward(self, x):  # (B, T, h)
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x):  # (B, T, h)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ_LEN, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * LAYERS) if name.endswith(("o.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.normal_(p, std=0.02)  # non-zero, so that a bias added tp times would show

    def forward(self, idx):  # (B, T) -> (B, T, V)
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model():
    return TinyGPT()
'''

TP_RULES = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
            "mlp.gate": "colwise", "mlp.up": "colwise", "mlp.down": "rowwise"}
UNIT_NAMES = ["wte", "wpe", *(f"blocks.{i}" for i in range(LAYERS)), "ln_f", "head"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Each rank is a child of one fork server that has imported torch and zplan's runtime once: a fresh
# interpreter spends ~4 s of CPU on those imports, most of this file's time on 2 cores otherwise. The rank
# then runs its script as __main__ (runpy) with the environment torchrun gives it, so the script's code
# path is the same as under torchrun.
_PRELOAD = ["torch", "torch.distributed.tensor.parallel", "torch.distributed.fsdp",
            "torch.distributed._composable.replicate_with_fsdp", "zplan.runtime", "rich.progress",
            *([__name__] if __name__ != "__main__" else [])]  # this file: each rank unpickles _rank_main from it


def _rank_main(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """One rank: output to `log_path`, environment `env`, then `python argv...`; exits with its status."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(env)
    torch.set_num_threads(1)  # OMP_NUM_THREADS is read when torch loads, which was before the fork
    sys.argv = list(argv)
    status = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_like_torchrun(world: int, argv: list[str], log_dir: Path) -> tuple[int, str]:
    """Run `python argv...` as `world` ranks with the environment torchrun gives them (RANK, WORLD_SIZE,
    MASTER_ADDR, ...); return the worst exit status and the ranks' output."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # takes effect when the fork server starts (first use)
    port = str(_free_port())
    log_dir.mkdir(parents=True, exist_ok=True)
    processes = []
    for rank in range(world):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        process = context.Process(target=_rank_main, args=(argv, env, str(log_dir / f"rank{rank}.log")))
        process.start()
        processes.append(process)
    for process in processes:
        process.join(timeout=240)
    for process in processes:
        if process.is_alive():  # a hung collective: stop the rank, report it
            process.kill()
            process.join()
    logs = [log_dir / f"rank{rank}.log" for rank in range(world)]
    output = "\n".join(log.read_text() if log.exists() else f"{log.name}: the rank did not start" for log in logs)
    return max(abs(p.exitcode) if p.exitcode is not None else 1 for p in processes), output


# ---- the emitted script against one process ------------------------------------------------------------


def make_plan(model_path: Path, *, tp: int, dp: int, zero_stage: int, sequence_parallel: bool,
              recompute: str = "none") -> Plan:
    """A hand-made plan: the fields the runtime reads are real, the predictions are placeholders."""
    micro_batch, num_micro_batches = GLOBAL_BATCH // dp // 2, 2
    layers = [LayerCost(name=n, kind="block" if n.startswith("blocks") else "other", params=0, fwd_flops=0.0,
                        act_bytes=0.0) for n in UNIT_NAMES]
    return Plan(
        zplan_version="test",
        fingerprint=Fingerprint(model_ref=str(model_path), cluster=CPU_LOCAL.name, world_size=tp * dp,
                                model_sha256=hashlib.sha256(model_path.read_bytes()).hexdigest()),
        model=ModelSummary(
            name="tiny-tp-gpt", source="file", tracer="hand", num_blocks=LAYERS, hidden=HIDDEN, heads=HEADS,
            kv_heads=KV_HEADS, ffn_hidden=3 * HIDDEN, vocab=VOCAB, seq_len=SEQ_LEN, params=1, layers=layers,
            block_prefix="blocks",
            tp_rules=[TensorParallelRule(module=m, style=s) for m, s in TP_RULES.items()],
        ),
        cluster=CPU_LOCAL,
        train=TrainSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, precision="fp32"),
        pins=Pins(zero=zero_stage, tp=tp),
        parallel=ParallelConfig(
            tp=tp, pp=1, dp=dp, micro_batch=micro_batch, num_micro_batches=num_micro_batches,
            zero_stage=zero_stage, recompute=recompute, sequence_parallel=sequence_parallel, interleave=1,
            schedule="none", offload="none",
        ),
        stages=[Stage(index=0, first_layer=0, last_layer=len(UNIT_NAMES) - 1, layer_names=UNIT_NAMES,
                      fwd_flops_per_sample=0.0, params=0)],
        placement=Placement(parameters="gpu", gradients="gpu", optimizer="gpu"),
        prediction=Prediction(step_time_s=0.01, tokens_per_s=1.0, mfu=0.01, model_flops_per_step=1e6,
                              memory=MemoryBreakdown(**dict.fromkeys(MemoryBreakdown.model_fields, 0.0)),
                              time=TimeBreakdown(**dict.fromkeys(TimeBreakdown.model_fields, 0.0)),
                              feasible=True),
        candidates_evaluated=1, alternatives=[], rejected=[], assumptions=[],
    )


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny_tp_gpt.py"
    path.write_text(TINY_TP_GPT)
    return path


@pytest.fixture(scope="module")
def reference(model_path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole global batch at once, plain torch AdamW (fused, as the runtime uses)."""
    torch.manual_seed(SEED)
    model = _import(model_path, "tiny_tp_gpt_reference").build_model()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=LR, fused=True,
    )
    schedule = WarmupCosine(max_lr=LR, warmup_steps=max(1, STEPS // 10), total_steps=STEPS)
    losses = []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = schedule(step)
        tokens = synthetic_token_batch(VOCAB, SEQ_LEN, GLOBAL_BATCH, SEED, step)  # (B, T)
        logits = model(tokens)  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_emitted_script(plan: Plan, model_path: Path, out_dir: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Emit train.py for `plan`, run it on tp * dp processes; return (per-step records, final weights)."""
    out_dir.mkdir(parents=True)
    (out_dir / "plan.json").write_text(plan.model_dump_json(indent=2))
    render_script_files(plan, out_dir, os.path.relpath(model_path, out_dir))
    log, weights = out_dir / "log.jsonl", out_dir / "weights.pt"
    args = ["--steps", str(STEPS), "--seed", str(SEED), "--lr", str(LR), "--log-json", str(log),
            "--save-weights", str(weights)]
    world = plan.parallel.tp * plan.parallel.dp
    returncode, output = run_like_torchrun(world, [str(out_dir / "train.py"), *args], out_dir / "logs")
    assert returncode == 0, output[-8000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return records, torch.load(weights)


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp, dp, zero_stage, sequence_parallel, recompute",
    [
        (2, 1, 0, False, "none"),
        (2, 1, 0, True, "full"),
        (2, 2, 0, False, "none"),
        (2, 2, 3, True, "none"),
    ],
    ids=["tp2", "tp2-sp-recompute", "dp2xtp2-zero0", "dp2xtp2-zero3-sp"],
)
def test_emitted_script_matches_single_process(tp, dp, zero_stage, sequence_parallel, recompute, model_path,
                                                reference, tmp_path):
    plan = make_plan(model_path, tp=tp, dp=dp, zero_stage=zero_stage, sequence_parallel=sequence_parallel,
                     recompute=recompute)
    records, weights = run_emitted_script(plan, model_path, tmp_path / "out")
    ref_losses, ref_weights = reference

    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    max_loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    assert set(weights) == set(ref_weights)
    assert all(weights[k].shape == ref_weights[k].shape for k in ref_weights)  # gathered, not shards
    max_param_diff = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    print(f"tp={tp} dp={dp} ZeRO {zero_stage} sp={sequence_parallel} recompute={recompute}: "
          f"max |loss - single process| = {max_loss_diff:.2e}, max |parameter - single process| = "
          f"{max_param_diff:.2e}")
    assert max_loss_diff <= 1e-5, (losses, ref_losses)
    assert max_param_diff <= 1e-5
    # the parameters moved (lr 1e-3 for 3 steps): equal weights are not just the initial ones
    torch.manual_seed(SEED)
    initial = _import(model_path, "tiny_tp_gpt_initial").build_model().state_dict()
    assert max((weights[k] - initial[k]).abs().max().item() for k in initial) > 1e-4


# ---- the examples under tp=2: forward and backward against the unsplit model ----------------------------

EXAMPLES = {  # file: (build_model keywords, block prefix, tp rules as the planner derives them)
    "tiny.py": ({}, "blocks", ["attn.q", "attn.k", "attn.v", "mlp.up"], ["attn.o", "mlp.down"]),
    "gpt.py": (dict(num_layers=2, hidden=64, heads=4, vocab_size=128, max_seq_len=32), "blocks",
               ["attn.q", "attn.k", "attn.v", "mlp.up"], ["attn.o", "mlp.down"]),
    "llama.py": (dict(num_layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab_size=128), "layers",
                 ["attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"], ["attn.o", "mlp.down"]),
}


def _examples_worker() -> None:
    """Per example and sequence-parallel setting: logits and gradients of the tp=2 model against the
    unsplit model built under the same seed on this rank. Rank 0 prints one JSON line per case."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from zplan.runtime.apply import apply_tensor_parallel
    from zplan.runtime.mesh import build_mesh

    dist.init_process_group("gloo")
    mesh = build_mesh(pp=1, dp=1, tp=dist.get_world_size(), device_type="cpu")
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))  # (B, T)
    for file, (kwargs, prefix, colwise, rowwise) in EXAMPLES.items():
        example = _import(REPO / "examples" / file, f"example_{file[:-3]}")
        tp_plan = {**dict.fromkeys(colwise, "colwise"), **dict.fromkeys(rowwise, "rowwise")}
        for sequence_parallel in (False, True):
            models = []
            for split in (False, True):
                torch.manual_seed(SEED)
                model = example.build_model(**kwargs)
                if split:
                    model = apply_tensor_parallel(model, mesh["tp"], tp_plan, prefix, sequence_parallel)
                logits = model(tokens)  # (B, T, V)
                F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
                models.append((model, logits))
            (full, full_logits), (split_model, split_logits) = models
            full_grads = {name: p.grad for name, p in full.named_parameters()}
            grads = {name: p.grad.full_tensor() for name, p in split_model.named_parameters()}
            record = {
                "example": file, "sequence_parallel": sequence_parallel,
                "all_dtensor": all(isinstance(p, DTensor) for p in split_model.parameters()),
                "sharded": sorted(name for name, p in split_model.named_parameters()
                                  if p.to_local().shape != p.shape),
                "same_names": set(grads) == set(full_grads),
                "max_logit_diff": (split_logits - full_logits).abs().max().item(),
                "max_grad_diff": max((grads[n] - full_grads[n]).abs().max().item() for n in full_grads),
            }
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps(record), flush=True)
    dist.destroy_process_group()


@pytest.mark.slow
def test_examples_keep_their_heads_under_tensor_parallel(tmp_path):
    returncode, output = run_like_torchrun(2, [__file__, "examples"], tmp_path)
    assert returncode == 0, output[-8000:]
    records = [json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(records) == 2 * len(EXAMPLES), output[-4000:]
    for record in records:
        print(record)
        kwargs, prefix, colwise, rowwise = EXAMPLES[record["example"]]
        expected = {f"{prefix}.{i}.{path}.weight" for i in range(2) for path in colwise + rowwise}
        assert record["all_dtensor"] and record["same_names"]
        assert set(record["sharded"]) >= expected  # (and the colwise biases)
        assert record["max_logit_diff"] <= 1e-5 and record["max_grad_diff"] <= 1e-5, record


# ---- refusals (one process, no launch) ----------------------------------------------------------------


def test_splits_that_cannot_work_are_refused():
    """Llama with 2 key/value heads cannot go to tp=4 (a rank would hold half a head); a plan naming a
    module the model lacks, or a parameterised module among the split Linears, is refused too."""
    from zplan.errors import PlanMismatchError
    from zplan.runtime.tensor_parallel import check_block_split

    example = _import(REPO / "examples" / "llama.py", "example_llama_refusal")
    block = example.build_model(num_layers=1, hidden=64, heads=8, kv_heads=2, ffn_hidden=96, vocab_size=128).layers[0]
    plan = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
            "mlp.gate": "colwise", "mlp.up": "colwise", "mlp.down": "rowwise"}
    assert check_block_split(block, "layers.0", plan, 2, sequence_parallel=True) == ["attn_norm", "mlp_norm"]
    with pytest.raises(PlanMismatchError, match=r"layers\.0\.attn\.k has 2 heads of 8, not a multiple of tp=4"):
        check_block_split(block, "layers.0", plan, 4, sequence_parallel=False)
    with pytest.raises(PlanMismatchError, match=r"layers\.0\.attn\.proj does not exist"):
        check_block_split(block, "layers.0", {"attn.proj": "rowwise"}, 2, sequence_parallel=False)
    block.attn.q_norm = torch.nn.RMSNorm(8)  # per-head: would see this rank's heads only
    with pytest.raises(PlanMismatchError, match=r"layers\.0\.attn\.q_norm \(RMSNorm\) has parameters of its own"):
        check_block_split(block, "layers.0", plan, 2, sequence_parallel=False)


def test_zero1_with_tensor_parallel_is_refused_clearly():
    from zplan.runtime.tensor_parallel import replicate_over_data_parallel

    with pytest.raises(NotImplementedError, match="ZeroRedundancyOptimizer cannot hold DTensor"):
        replicate_over_data_parallel(torch.nn.Linear(2, 2), None, 1, None, "blocks")


if __name__ == "__main__" and sys.argv[1:] == ["examples"]:
    _examples_worker()
