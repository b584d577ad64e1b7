"""Shard-by-shard materialisation on 2 processes (gloo): under ZeRO-3 (dp=2) and under tensor parallel
(tp=2), each rank's local shards equal the slices of the single-process `torch.manual_seed(seed);
build_model()`, the gathered tensors equal it whole, and no rank made a full copy of the model.

The expected slices are computed here by hand (torch.chunk along the dimension the split cuts), not by
the runtime's slicing code; the gathered tensors come from DTensor's own all-gather.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import REPO, Ranks, import_file

SEED = 7
SIZES = dict(num_layers=2, hidden=64, heads=4, vocab_size=128, max_seq_len=32)
COLWISE = ["attn.q", "attn.k", "attn.v", "mlp.up"]  # weight (out/tp, in), bias (out/tp,)
ROWWISE = ["attn.o", "mlp.down"]  # weight (out, in/tp), bias replicated
SLACK_BYTES = 4096


def build_gpt():
    return import_file(REPO / "examples" / "gpt.py", "gpt_for_materialize").build_model(**SIZES)


def worker(mode: str, out_dir: str) -> None:
    """One rank: the meta model, the parallel step of `mode`, materialise; save what this rank holds."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from zplan.runtime import (
        apply_data_parallel,
        apply_tensor_parallel,
        build_mesh,
        build_meta_model,
        init_distributed,
        materialize_weights,
    )

    ctx = init_distributed()
    model, weights = build_meta_model(build_gpt, SEED)
    assert weights.program is not None, weights.fallback_reason
    if mode == "zero3":
        mesh = build_mesh(pp=1, dp=2, tp=1, device_type="cpu")
        model = apply_data_parallel(model, mesh["dp"], 3, "fp32", "none", "blocks")
    else:
        mesh = build_mesh(pp=1, dp=1, tp=2, device_type="cpu")
        plan = {**dict.fromkeys(COLWISE, "colwise"), **dict.fromkeys(ROWWISE, "rowwise")}
        model = apply_tensor_parallel(model, mesh["tp"], plan, "blocks", False)
    report = materialize_weights(model, weights, "cpu")
    local, full = {}, {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        local[name] = param.to_local().detach().clone()
        full[name] = param.full_tensor().detach().clone()  # collective: DTensor's all-gather
    torch.save({"local": local, "full": full, "report": vars(report),
                "tied": model.lm_head.weight is model.wte.weight},
               Path(out_dir) / f"rank{ctx.rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def expected_local(mode: str, name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's slice by hand: ZeRO-3 cuts every parameter along dim 0 (FSDP2: torch.chunk);
    tensor parallel cuts colwise Linears along dim 0, rowwise weights along dim 1, replicates the rest."""
    if mode == "zero3":
        return tensor.chunk(2, dim=0)[rank]
    module = name.split(".", 2)[-1].rpartition(".")[0]  # 'blocks.0.attn.q.weight' -> 'attn.q'
    if name.startswith("blocks.") and module in COLWISE:
        return tensor.chunk(2, dim=0)[rank]
    if name.startswith("blocks.") and module in ROWWISE and name.endswith(".weight"):
        return tensor.chunk(2, dim=1)[rank]
    return tensor


@pytest.mark.parametrize("mode", ["zero3", "tp"])
def test_each_rank_holds_its_slices_of_the_single_process_init(mode, tmp_path):
    Ranks([__file__, mode, str(tmp_path)], 2, tmp_path / "logs").wait_ok()
    torch.manual_seed(SEED)
    reference = dict(build_gpt().named_parameters())
    model_bytes = sum(t.nbytes for t in reference.values())
    largest = max(t.nbytes for t in reference.values())
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["tied"]
        assert set(saved["local"]) == set(reference)
        held = 0
        for name, tensor in reference.items():
            assert torch.equal(saved["full"][name], tensor), name
            assert torch.equal(saved["local"][name], expected_local(mode, name, tensor, rank)), name
            held += saved["local"][name].nbytes
        report = saved["report"]
        assert report["fallback_reason"] is None
        assert report["shard_bytes"] == held < model_bytes  # a rank keeps its shards, not the model
        assert report["largest_full_tensor_bytes"] == largest
        assert largest <= report["peak_replay_bytes"] <= largest + SLACK_BYTES  # one full tensor at a time
        if mode == "zero3":
            assert held == model_bytes // 2  # every dim 0 here is even: half each


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    worker(sys.argv[1], sys.argv[2])
