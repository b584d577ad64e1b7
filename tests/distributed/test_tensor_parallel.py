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

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.harness import (
    REPO,
    Ranks,
    import_file,
    max_loss_diff,
    max_weight_diff,
    run_emitted_script,
    train_single_process,
)
from tests.plan_samples import gpt_unit_names, runnable_plan
from zplan.schemas import Plan

STEPS = 3
SEED = 5
LR = 1e-3  # the script's --lr; weight decay and clipping are train.py's defaults (harness.py)
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


# ---- the emitted script against one process ------------------------------------------------------------


def make_plan(model_path: Path, *, tp: int, dp: int, zero_stage: int, sequence_parallel: bool,
              recompute: str = "none", vocab_parallel: bool = False) -> Plan:
    """A hand-made tp x dp plan for the tiny GPT, 2 micro-batches per step; `vocab_parallel`: its tied embedding and
    head split by vocabulary rows over tp (runtime/parallel/vocab_parallel.py), the default loss on each rank's
    logits."""
    plan = runnable_plan(model_path, units=gpt_unit_names(LAYERS), hidden=HIDDEN, heads=HEADS, vocab=VOCAB,
                         seq_len=SEQ_LEN, micro_batch=GLOBAL_BATCH // dp // 2, num_micro_batches=2, tp=tp, dp=dp,
                         zero_stage=zero_stage, recompute=recompute, sequence_parallel=sequence_parallel,
                         kv_heads=KV_HEADS, ffn_hidden=3 * HIDDEN, tp_rules=TP_RULES, name="tiny-tp-gpt")
    return plan.model_copy(update={"parallel": plan.parallel.model_copy(update={"vocab_parallel": vocab_parallel})})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny_tp_gpt.py"
    path.write_text(TINY_TP_GPT)
    return path


@pytest.fixture(scope="module")
def reference(model_path) -> tuple[list[float], dict[str, torch.Tensor]]:
    build_model = import_file(model_path, "tiny_tp_gpt_reference").build_model
    return train_single_process(build_model, steps=STEPS, seed=SEED, lr=LR, global_batch=GLOBAL_BATCH, vocab=VOCAB,
                                seq_len=SEQ_LEN)


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp, dp, zero_stage, sequence_parallel, recompute, vocab_parallel",
    [
        (2, 1, 0, False, "none", False),
        (2, 1, 0, True, "full", False),
        (2, 2, 0, False, "none", False),
        (2, 2, 1, True, "none", False),
        (2, 2, 3, True, "none", False),
        (2, 1, 0, False, "none", True),
        (2, 2, 1, True, "full", True),
        (2, 2, 3, True, "none", True),
    ],
    ids=["tp2", "tp2-sp-recompute", "dp2xtp2-zero0", "dp2xtp2-zero1-sp", "dp2xtp2-zero3-sp", "tp2-vocab",
         "dp2xtp2-zero1-sp-recompute-vocab", "dp2xtp2-zero3-sp-vocab"],
)
def test_emitted_script_matches_single_process(tp, dp, zero_stage, sequence_parallel, recompute, vocab_parallel,
                                                model_path, reference, tmp_path):
    plan = make_plan(model_path, tp=tp, dp=dp, zero_stage=zero_stage, sequence_parallel=sequence_parallel,
                     recompute=recompute, vocab_parallel=vocab_parallel)
    records, weights = run_emitted_script(plan, model_path, tmp_path / "out", steps=STEPS, seed=SEED, lr=LR)
    ref_losses, ref_weights = reference

    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    loss_diff = max_loss_diff(losses, ref_losses)
    assert set(weights) == set(ref_weights)
    assert all(weights[k].shape == ref_weights[k].shape for k in ref_weights)  # gathered, not shards
    param_diff = max_weight_diff(weights, ref_weights)
    print(f"tp={tp} dp={dp} ZeRO {zero_stage} sp={sequence_parallel} recompute={recompute}: "
          f"max |loss - single process| = {loss_diff:.2e}, max |parameter - single process| = "
          f"{param_diff:.2e}")
    assert loss_diff <= 1e-5, (losses, ref_losses)
    assert param_diff <= 1e-5
    # the parameters moved (lr 1e-3 for 3 steps): equal weights are not just the initial ones
    torch.manual_seed(SEED)
    initial = import_file(model_path, "tiny_tp_gpt_initial").build_model().state_dict()
    assert max((weights[k] - initial[k]).abs().max().item() for k in initial) > 1e-4
    if zero_stage == 1:
        _check_zero1_state_bytes(records[0], initial, tp=tp, dp=dp, vocab_parallel=vocab_parallel)


def _check_zero1_state_bytes(record: dict, initial: dict[str, torch.Tensor], *, tp: int, dp: int,
                             vocab_parallel: bool = False) -> None:
    """ZeRO-1 over tp: rank 0 holds fp32 parameters and gradients of its tp-local tensors (a 1/tp slice of
    each split Linear, the rest whole) and Adam moments (2 x fp32) of its dp chunk of those tensors' rows
    (ceil(rows/dp), dp rank 0's chunk) plus a float32 step per parameter. The hand-made plan carries no
    memory prediction (0), so the logged bytes are compared with this count, made here from the shapes
    and TP_RULES alone (with a split vocabulary, the token table's rows too), and the moments with the planner's ZeRO-1
    term 8 * (tp-local parameters) / dp."""
    split_dims = {f"blocks.{i}.{path}.{kind}": (0 if style == "colwise" else 1)
                  for i in range(LAYERS) for path, style in TP_RULES.items() for kind in ("weight", "bias")
                  if style == "colwise" or kind == "weight"}
    if vocab_parallel:  # the tied token table split by its vocabulary rows
        split_dims["wte.weight"] = 0
    params = {k: v for k, v in initial.items() if k != "head.weight"}  # tied to wte.weight: one parameter
    local_numel = moment_numel = 0
    for name, tensor in params.items():
        shape = list(tensor.shape)
        if name in split_dims:
            shape[split_dims[name]] //= tp
        local_numel += math.prod(shape)
        moment_numel += -(-shape[0] // dp) * math.prod(shape[1:])  # dp rank 0's rows of the tp-local tensor
    expected = 4 * local_numel * 2 + 4 * 2 * moment_numel + 4 * len(params)
    optimizer = record["model_state_bytes"] - 4 * local_numel * 2
    whole_model = sum(t.numel() for t in params.values())
    print(f"ZeRO-1 dp={dp} x tp={tp}: model states {record['model_state_bytes']} B per rank (by hand {expected}); "
          f"optimizer {optimizer} B = {optimizer / (8 * whole_model):.3f} of the whole model's Adam moments "
          f"(1/(dp*tp) = {1 / (dp * tp):.3f}; the embeddings and norms are replicated over tp)")
    assert record["predicted_model_state_bytes"] == 0  # the hand-made plan: no prediction to compare with
    assert record["model_state_bytes"] == expected
    assert abs(optimizer / (8 * local_numel / dp) - 1) <= 0.05


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

    from zplan.runtime.parallel.mesh import build_mesh
    from zplan.runtime.parallel.tensor_parallel import apply_tensor_parallel

    dist.init_process_group("gloo")
    mesh = build_mesh(pp=1, dp=1, tp=dist.get_world_size(), device_type="cpu")
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))  # (B, T)
    for file, (kwargs, prefix, colwise, rowwise) in EXAMPLES.items():
        example = import_file(REPO / "examples" / file, f"example_{file[:-3]}")
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
    output = Ranks([__file__, "examples"], 2, tmp_path).wait_ok()
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
    module the model lacks, or a parameterised module among the split Linears, is refused too; a norm of each head
    (Qwen3's q_norm) is not."""
    from zplan.errors import PlanMismatchError
    from zplan.runtime.parallel.tensor_parallel import check_block_split, head_norms

    example = import_file(REPO / "examples" / "llama.py", "example_llama_refusal")
    block = example.build_model(num_layers=1, hidden=64, heads=8, kv_heads=2, ffn_hidden=96, vocab_size=128).layers[0]
    plan = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
            "mlp.gate": "colwise", "mlp.up": "colwise", "mlp.down": "rowwise"}
    assert check_block_split(block, "layers.0", plan, 2, sequence_parallel=True) == ["attn_norm", "mlp_norm"]
    with pytest.raises(PlanMismatchError, match=r"layers\.0\.attn\.k has 2 heads of 8, not a multiple of tp=4"):
        check_block_split(block, "layers.0", plan, 4, sequence_parallel=False)
    with pytest.raises(PlanMismatchError, match=r"layers\.0\.attn\.proj does not exist"):
        check_block_split(block, "layers.0", {"attn.proj": "rowwise"}, 2, sequence_parallel=False)
    block.attn.q_norm = torch.nn.RMSNorm(8)  # per head (head_dim 8): a rank holds whole heads, so it runs
    check_block_split(block, "layers.0", plan, 2, sequence_parallel=False)
    assert head_norms(block, plan) == ["attn.q_norm"]
    block.attn.q_norm = torch.nn.RMSNorm(64)  # over all heads' features: would see this rank's heads only
    with pytest.raises(PlanMismatchError, match=r"layers\.0\.attn\.q_norm \(RMSNorm\) has parameters of its own"):
        check_block_split(block, "layers.0", plan, 2, sequence_parallel=False)


if __name__ == "__main__" and sys.argv[1:] == ["examples"]:
    _examples_worker()
