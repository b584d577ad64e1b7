"""Context parallelism's pieces on one process (runtime/parallel/context_parallel.py): the batch split against a
hand-written example, and the attention of every cp rank, simulated with a gather that concatenates the ranks' parts,
against full causal scaled_dot_product_attention sliced to each rank's queries (values and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zplan.errors import PlanMismatchError
from zplan.runtime.parallel.context_parallel import (
    IGNORE_INDEX,
    ContextParallelAttention,
    chunk_positions,
    context_parallel_attention,
    context_parallel_loss,
    shard_batch,
)


def test_chunks_r_and_2cp_minus_1_minus_r():
    # s = 16, cp = 2: 4 chunks of 4; rank 0 chunks 0 and 3, rank 1 chunks 1 and 2 (by hand)
    assert chunk_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # cp = 4 over 8 tokens: chunks of 1, rank r holds r and 7 - r
    assert [chunk_positions(8, r, 4).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    with pytest.raises(PlanMismatchError, match="multiple of 4"):
        chunk_positions(10, 0, 2)


def test_shard_batch_keeps_every_target():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27]])  # (B=2, s=8)
    first, second = (shard_batch(ids, r, 2) for r in range(2))
    assert first.inputs["input_ids"].tolist() == [[10, 11, 16, 17], [20, 21, 26, 27]]
    assert first.inputs["position_ids"].tolist() == [[0, 1, 6, 7], [0, 1, 6, 7]]
    # the target of position 1 (token 12) is on the other rank's side of the boundary; position 7 has none
    assert first.targets.tolist() == [[11, 12, 17, IGNORE_INDEX], [21, 22, 27, IGNORE_INDEX]]
    assert second.inputs["input_ids"].tolist() == [[12, 13, 14, 15], [22, 23, 24, 25]]
    assert second.targets.tolist() == [[13, 14, 15, 16], [23, 24, 25, 26]]
    assert first.target_count == second.target_count == 2 * 7
    assert shard_batch({"input_ids": ids}, 1, 2).targets.tolist() == second.targets.tolist()
    with pytest.raises(PlanMismatchError, match="attention_mask"):
        shard_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 0, 2)


def test_loss_summed_over_ranks_is_cp_times_the_mean():
    torch.manual_seed(0)
    ids, logits = torch.randint(0, 11, (3, 12)), torch.randn(3, 12, 11)  # (B, s), (B, s, V)
    mean = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())  # the one-process next-token loss
    cp = 3
    shares = [context_parallel_loss(logits[:, chunk_positions(12, r, cp)], shard_batch(ids, r, cp)) for r in range(cp)]
    torch.testing.assert_close(sum(shares), cp * mean)


def gather_from(k, v, parts):
    """What the all-gather of k and v stacked, (2, B, H, s/cp, d), returns on every cp rank: each rank's slice of
    the full tensors in rank order (autograd reaches the full tensors: the reduce-scatter's sum)."""
    def gather(x, dim):
        assert x.dim() == 5 and dim == 3  # k and v stacked, along the sequence
        full = torch.stack([k, v])  # (2, B, H, s, d)
        return torch.cat([full.index_select(dim, p) for p in parts], dim=dim)

    return gather


def simulated_ranks(q, k, v, cp, **kwargs):
    """Each cp rank's attention output (B, H, s/cp, d) and positions."""
    parts = [chunk_positions(q.shape[2], r, cp) for r in range(cp)]
    gather = gather_from(k, v, parts)
    return [context_parallel_attention(q[:, :, p], k[:, :, p], v[:, :, p], positions=p, cp_size=cp, gather=gather,
                                       **kwargs) for p in parts], parts


@pytest.mark.parametrize("cp, heads_kv, gqa", [(2, 4, False), (4, 4, False), (2, 2, True)])
def test_attention_equals_full_causal_attention(cp, heads_kv, gqa):
    torch.manual_seed(1)
    b, heads, s, d = 2, 4, 16, 8
    q = torch.randn(b, heads, s, d, requires_grad=True)
    k, v = (torch.randn(b, heads_kv, s, d, requires_grad=True) for _ in range(2))
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # (B, H, s, d)
    outputs, parts = simulated_ranks(q, k, v, cp, is_causal=True, enable_gqa=gqa)
    for out, p in zip(outputs, parts, strict=True):
        torch.testing.assert_close(out, reference[:, :, p], rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(reference)
    expected = torch.autograd.grad(reference, (q, k, v), grad)
    local = sum((out * grad[:, :, p]).sum() for out, p in zip(outputs, parts, strict=True))
    for got, want in zip(torch.autograd.grad(local, (q, k, v)), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_causal_masks_pass_and_padding_masks_are_refused():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    p = chunk_positions(8, 0, 2)  # [0, 1, 6, 7]
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    packed = causal & torch.tensor([0, 0, 1, 1])[:, None].eq(torch.tensor([0, 0, 1, 1])[None, :])
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, p]
    gather = gather_from(k, v, [p, chunk_positions(8, 1, 2)])
    for mask in (causal, packed, torch.zeros(4, 4).masked_fill(~causal, float("-inf"))):  # bool, packed, float
        out = context_parallel_attention(q[:, :, p], k[:, :, p], v[:, :, p], attn_mask=mask, positions=p,
                                         cp_size=2, gather=gather)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    padding = causal.clone()
    padding[:, 0] = False  # the first key masked out: padding
    with pytest.raises(PlanMismatchError, match="padding"):
        context_parallel_attention(q[:, :, p], k[:, :, p], v[:, :, p], attn_mask=padding, positions=p, cp_size=2,
                                   gather=lambda x, dim: x)
    with pytest.raises(PlanMismatchError, match="bidirectional"):
        context_parallel_attention(q[:, :, p], k[:, :, p], v[:, :, p], positions=p, cp_size=2, gather=lambda x, d: x)


def test_mode_intercepts_scaled_dot_product_attention(monkeypatch):
    """Inside ContextParallelAttention the model's own F.scaled_dot_product_attention call is the gathered one."""
    import zplan.runtime.parallel.context_parallel as cp_module

    calls = []
    monkeypatch.setattr(cp_module, "gather_sequence", lambda x, dim, group: calls.append(dim) or x)
    q = torch.randn(1, 2, 4, 4)
    with ContextParallelAttention(torch.arange(4), 1, None):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert calls == [3]  # k and v stacked, gathered along the sequence
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, is_causal=True))


def test_every_layer_saves_the_one_mask_of_its_scope(monkeypatch):
    """Inside a scope the (s/cp, s) attention mask is made once, in the queries' dtype, and every layer's attention
    saves that one tensor for its backward (a boolean mask per call is converted to an additive one, and saved, by
    each call: a copy per layer); the outputs are still the full causal attention's."""
    import zplan.runtime.parallel.context_parallel as cp_module

    torch.manual_seed(4)
    b, heads, s, d, cp = 1, 4, 16, 8, 2
    q = torch.randn(b, heads, s, d, requires_grad=True)
    k, v = (torch.randn(b, 2, s, d, requires_grad=True) for _ in range(2))
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    parts = [chunk_positions(s, r, cp) for r in range(cp)]
    gather = gather_from(k, v, parts)
    monkeypatch.setattr(cp_module, "gather_sequence", lambda x, dim, group: gather(x, dim))
    p = parts[0]
    masks = []

    def keep_masks(tensor):
        if tensor.shape == (s // cp, s):
            masks.append(tensor)
        return tensor

    with ContextParallelAttention(p, cp, None), torch.autograd.graph.saved_tensors_hooks(keep_masks, lambda t: t):
        outputs = [F.scaled_dot_product_attention(q[:, :, p], k[:, :, p], v[:, :, p], is_causal=True, enable_gqa=True)
                   for _layer in range(3)]
    for out in outputs:
        torch.testing.assert_close(out, reference[:, :, p], rtol=1e-5, atol=1e-6)
    assert len(masks) == 3 and len({m.untyped_storage().data_ptr() for m in masks}) == 1
    assert masks[0].dtype == q.dtype
    visible = masks[0] == 0  # by hand: rank 0 holds positions 0-3 and 12-15; position i sees keys 0..i
    assert visible.tolist() == [[j <= i for j in range(s)] for i in [0, 1, 2, 3, 12, 13, 14, 15]]


# ---- check_plan: what cp > 1 refuses, before any collective ------------------------------------------------


def cp_plan(model_file, *, cp: int = 2, dp: int = 1, seq_len: int = 8, **parallel):
    """A runnable plan for `model_file` on cp * dp processes, edited to context parallel."""
    import hashlib

    from tests.plan_samples import runnable_plan

    plan = runnable_plan(str(model_file), model_sha256=hashlib.sha256(model_file.read_bytes()).hexdigest(),
                         units=["blocks.0"], hidden=4, heads=1, vocab=4, seq_len=seq_len, ffn_hidden=4, micro_batch=2,
                         num_micro_batches=1, dp=cp * dp, zero_stage=0, name="m")
    return plan.model_copy(update={"parallel": plan.parallel.model_copy(update={"cp": cp, "dp": dp, **parallel})})


MODEL = "import torch\n\ndef build_model():\n    return torch.nn.Linear(4, 4)\n"


def check(plan, model_file, world):
    from zplan.runtime.plan.check import check_plan

    check_plan(plan, model_file, world)


def test_check_plan_counts_cp_in_the_world_and_refuses_what_cp_cannot_run(tmp_path):
    model_file = tmp_path / "model.py"
    model_file.write_text(MODEL)
    check(cp_plan(model_file), model_file, 2)  # cp 2 x dp 1 on 2 processes runs
    plan = cp_plan(model_file)  # made for 2 processes, edited to cp 2 x dp 2
    with pytest.raises(PlanMismatchError, match=r"tp\*pp\*dp\*cp = 4 != its world size 2"):
        check(plan.model_copy(update={"parallel": plan.parallel.model_copy(update={"dp": 2})}), model_file, 2)
    with pytest.raises(PlanMismatchError, match="multiple of 4"):
        check(cp_plan(model_file, seq_len=6), model_file, 2)
    with pytest.raises(PlanMismatchError, match="cpu offload"):
        check(cp_plan(model_file, offload="cpu", zero_stage=3), model_file, 2)


def test_check_plan_refuses_a_model_files_own_loss_under_cp(tmp_path):
    model_file = tmp_path / "model.py"
    model_file.write_text(MODEL + "\n\ndef loss_fn(outputs, batch):\n    return outputs.sum()\n")
    with pytest.raises(PlanMismatchError, match="defines its own loss_fn"):
        check(cp_plan(model_file), model_file, 2)
    plan = cp_plan(model_file)
    check(plan.model_copy(update={"parallel": plan.parallel.model_copy(update={"cp": 1, "dp": 2})}), model_file, 2)


def test_activation_recompute_runs_the_same_attention_in_the_backward(monkeypatch):
    """torch.utils.checkpoint recomputes the forward inside the backward, where no torch function mode runs: the
    recompute must take the context-parallel attention too (else it saves other tensors: CheckpointError), and the
    gradients equal those without recompute."""
    from torch.utils.checkpoint import checkpoint

    import zplan.runtime.parallel.context_parallel as cp_module

    monkeypatch.setattr(cp_module, "gather_sequence", lambda x, dim, group: x)  # one rank: the gather is x
    torch.manual_seed(3)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)

    def attention(q):  # (B, H, s, d) -> (B, H, s, d), calling F.scaled_dot_product_attention as a model does
        return F.scaled_dot_product_attention(q, q * 2, q * 3, is_causal=True)

    grads = []
    for recompute in (False, True):
        with ContextParallelAttention(torch.arange(8), 1, None):
            out = checkpoint(attention, q, use_reentrant=False) if recompute else attention(q)
            (grad,) = torch.autograd.grad(out.square().sum(), q)
        grads.append(grad)
    torch.testing.assert_close(grads[1], grads[0])
    assert F.scaled_dot_product_attention is cp_module._SDPA  # torch's own again after the scope


def test_dry_run_runs_a_context_parallel_plan(tmp_path):
    """zplan dryrun: the emitted program's calls on fake tensors in a fake world of pp*dp*cp*tp = 4 ranks (the gather,
    the reduce-scatter and the dp_cp mesh included); cp 2 x dp 2 under ZeRO-3."""
    pytest.importorskip("transformers")
    from tests.hf_zoo import deterministic_decoder_sources
    from zplan.api import compile_plan, prepare
    from zplan.dryrun import dry_run_plan
    from zplan.schemas import Pins

    llama = tmp_path / "hf_llama.py"
    llama.write_text(deterministic_decoder_sources()["llama"])
    plan = compile_plan(prepare(str(llama), 4, "dgx-h100", 8, 32, "fp32", Pins(tp=1, pp=1, zero=3, offload="none")))
    p = plan.parallel
    parallel = p.model_copy(update={"cp": 2, "dp": 2, "micro_batch": 2 * p.micro_batch})
    plan = plan.model_copy(update={"parallel": parallel})
    result = dry_run_plan(plan, str(llama), say=lambda message: None)
    assert result.world_size == 4 and [r.rank for r in result.ranks] == [0]
    assert result.ranks[0].measured_peak_bytes > 0
