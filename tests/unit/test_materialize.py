"""Shard-by-shard materialisation (runtime.training.init_replay, runtime.training.materialize) against the reference it
must equal: `torch.manual_seed(seed); build_fn()` in one process, compared bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from examples import gpt, llama, tiny
from zplan.runtime.training.init_replay import UnsupportedInit, record_init, replay_init
from zplan.runtime.training.materialize import build_meta_model, materialize_weights

SEED = 1234
REPO = Path(__file__).resolve().parents[2]
SLACK_BYTES = 4096  # replay bookkeeping beyond the largest tensor: a few small tensors at most


class Rotary(nn.Module):
    """Exercises what the examples do not: arithmetic buffers (a RoPE table), a plain tensor attribute,
    a constant from torch.tensor, partial writes (padding row, a slice), read-modify-write inits
    (trunc_normal_: uniform_, erfinv_, mul_, add_, clamp_), a `.data` swap, a transposed parameter."""

    def __init__(self, dim: int = 16, seq: int = 8, vocab: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)  # normal_, then row 0 filled with 0
        self.proj = nn.Linear(dim, dim)  # kaiming uniform_ then overwritten below
        nn.init.trunc_normal_(self.proj.weight, std=0.02)
        self.scale = nn.Parameter(torch.ones(dim))
        with torch.no_grad():
            self.scale[: dim // 2].mul_(torch.tensor(0.5))  # a slice and a constant
        self.gate = nn.Linear(dim, dim, bias=False)
        self.gate.weight.data = torch.randn(dim, dim).t().contiguous()  # swapped data
        self.kernel = nn.Parameter(torch.randn(dim, 2 * dim).t())  # (2*dim, dim), not contiguous
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # (dim/2,)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)  # (T, dim/2)
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos(), persistent=False)  # (T, dim)
        self.sin_table = torch.cat((angles, angles), -1).sin()  # a plain attribute (T, dim)


class ReadsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        if self.w.abs().max().item() > 100:  # data-dependent Python control flow
            self.w.data.zero_()


class OwnGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))


class SeedsItself(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.w = nn.Parameter(torch.randn(4, 4))


MODELS = {
    "tiny": tiny.build_model,
    "gpt": lambda: gpt.build_model(num_layers=2, hidden=64, heads=4, vocab_size=128, max_seq_len=32),
    "llama": lambda: llama.build_model(num_layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab_size=128),
    "rotary": Rotary,
}


def reference(build_fn, seed: int = SEED) -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    """The single-process build, every tensor by every name, and the next number the RNG gives after it."""
    torch.manual_seed(seed)
    model = build_fn()
    return model, all_tensors(model), torch.rand(8)


def all_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    named.update({f"{prefix}.{name}".lstrip("."): value for prefix, module in model.named_modules()
                  for name, value in vars(module).items()
                  if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)})
    return named


def model_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in {id(t): t for t in tensors.values()}.values())


@pytest.mark.parametrize("name", MODELS)
def test_replay_equals_the_single_process_build_bit_for_bit(name):
    build_fn = MODELS[name]
    meta_model, program = record_init(build_fn)
    _, expected, rng_after = reference(build_fn)
    got: dict[str, torch.Tensor] = {}
    stats = replay_init(program, SEED, list(program.outputs), lambda n, t: got.__setitem__(n, t.clone()))
    assert torch.equal(torch.rand(8), rng_after)  # the RNG is where the full build leaves it
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert torch.equal(got[key], tensor), key
    # Memory: about one full tensor at a time, not the model.
    largest = max(t.nbytes for t in expected.values())
    total = model_bytes(expected)
    assert largest <= stats.peak_live_bytes <= largest + SLACK_BYTES, (stats, largest)
    if name != "rotary":  # a model of many tensors (rotary has few): far below it
        assert stats.peak_live_bytes < total / 4, (stats.peak_live_bytes, total)
    assert stats.ops_scratch > 0  # overwritten random inits were drawn, not kept
    # The returned model holds no data.
    assert all(t.is_meta for t in all_tensors(meta_model).values())


def test_another_seed_gives_other_weights():
    _, program = record_init(MODELS["gpt"])
    _, expected, _ = reference(MODELS["gpt"], seed=SEED)
    got = {}
    replay_init(program, SEED + 1, ["wte.weight"], lambda n, t: got.__setitem__(n, t.clone()))
    assert not torch.equal(got["wte.weight"], expected["wte.weight"])


def test_part_of_the_model_is_made_alone_with_the_same_numbers():
    """A pipeline rank wants only its stages: the others' random inits are still drawn (into scratch)."""
    _, program = record_init(MODELS["gpt"])
    _, expected, rng_after = reference(MODELS["gpt"])
    wanted = [name for name in program.outputs if name.startswith("blocks.1.") or name.startswith("ln_f.")]
    got = {}
    stats = replay_init(program, SEED, wanted, lambda n, t: got.__setitem__(n, t.clone()))
    assert set(got) == set(wanted)
    assert all(torch.equal(got[k], expected[k]) for k in wanted)
    assert torch.equal(torch.rand(8), rng_after)
    largest = max(t.nbytes for t in expected.values())  # the embedding, drawn in scratch and dropped
    assert stats.peak_live_bytes <= largest + SLACK_BYTES


def test_meta_model_keeps_structure_and_ties():
    model, _ = record_init(MODELS["gpt"])
    full, _, _ = reference(MODELS["gpt"])
    assert model.lm_head.weight is model.wte.weight
    assert [(n, p.shape, p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)] == [
        (n, p.shape, p.requires_grad) for n, p in full.named_parameters(remove_duplicate=False)]
    rotary, _ = record_init(Rotary)
    assert rotary.kernel.shape == (32, 16) and rotary.kernel.stride() == (1, 32)
    assert "cos" not in rotary.state_dict() and rotary.sin_table.is_meta


@pytest.mark.parametrize("name", ["gpt", "rotary"])
def test_materialize_weights_fills_a_meta_model_like_the_full_build(name):
    model, weights = build_meta_model(MODELS[name], SEED)
    assert weights.program is not None and weights.fallback_reason is None
    report = materialize_weights(model, weights, "cpu")
    rng_next = torch.rand(8)
    full, expected, rng_after = reference(MODELS[name])
    assert torch.equal(rng_next, rng_after)
    got = all_tensors(model)
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert report.shard_bytes == model_bytes(expected)  # one process: its shards are the model
    assert report.largest_full_tensor_bytes == max(t.nbytes for t in expected.values())
    assert "materialised" in str(report) and "MiB" in str(report)
    if name == "gpt":
        assert model.lm_head.weight is model.wte.weight and model.wte.weight.device.type == "cpu"
        x = torch.randint(0, 128, (2, 16))
        assert torch.equal(model(x), full(x))


@pytest.mark.parametrize(("build_fn", "why"), [(ReadsValues, "reads tensor values"),
                                               (OwnGenerator, "explicit torch.Generator"),
                                               (SeedsItself, "calls torch.manual_seed")])
def test_a_model_that_cannot_be_recorded_is_built_in_full_with_a_warning(build_fn, why, capsys):
    with pytest.raises(UnsupportedInit, match=why):
        record_init(build_fn)
    model, weights = build_meta_model(build_fn, SEED)
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "zplan: warning: building the whole model" in warning and why in warning
    _, expected, _ = reference(build_fn)
    assert torch.equal(model.w, expected["w"]) and not model.w.is_meta
    report = materialize_weights(model, weights, "cpu")
    assert why in report.fallback_reason and "built in full" in str(report)


def test_the_model_files_own_error_is_not_hidden():
    def broken():
        raise ValueError("hidden must be even")

    with pytest.raises(ValueError, match="hidden must be even"):
        build_meta_model(broken, SEED)


def test_the_replay_of_a_large_model_holds_one_tensor_not_the_model():
    """GPT with 8 layers of hidden 256: the model is 28.2 MiB, the replay holds its largest tensor (4 MiB)."""
    build_fn = lambda: gpt.build_model(num_layers=8, hidden=256, heads=4, vocab_size=4096, max_seq_len=64)  # noqa: E731
    model, program = record_init(build_fn)
    sizes = {id(p): p.numel() * 4 for p in model.parameters()}
    stats = replay_init(program, SEED, list(program.outputs), lambda n, t: None)
    largest = program.largest_output_bytes
    assert largest == 4096 * 256 * 4  # the tied embedding / head, (V, h) fp32
    assert stats.peak_live_bytes <= largest + SLACK_BYTES
    assert stats.peak_live_bytes * 6 < sum(sizes.values())
    h, layers, vocab, seq = 256, 8, 4096, 64  # parameters by hand: embeddings, blocks, final norm
    block = 4 * (h * h + h) + 2 * 2 * h + (h * 4 * h + 4 * h) + (4 * h * h + h)  # attention, 2 norms, MLP
    assert sum(sizes.values()) == 4 * (vocab * h + seq * h + layers * block + 2 * h)


def fake_world_rank(rank: int) -> None:
    """Rank `rank` of a fake world of 4 (dp=2 x tp=2, no communication: none is needed to materialise):
    ZeRO-3 over tensor parallel. FSDP2 shards each tp shard along dim 0 (_StridedShard), so rank (d, t)
    holds chunk d of chunk t of a colwise weight's rows, chunk d of the rows of chunk t of a rowwise
    weight's columns, and chunk d of a replicated tensor."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zplan.runtime import apply_data_parallel, apply_tensor_parallel, build_mesh

    build_fn = MODELS["gpt"]
    _, expected, _ = reference(build_fn)
    plan = {**dict.fromkeys(["attn.q", "attn.k", "attn.v", "mlp.up"], "colwise"),
            **dict.fromkeys(["attn.o", "mlp.down"], "rowwise")}
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    mesh = build_mesh(pp=1, dp=2, tp=2, device_type="cpu")
    model, weights = build_meta_model(build_fn, SEED)
    model = apply_tensor_parallel(model, mesh["tp"], plan, "blocks", False)
    model = apply_data_parallel(model, mesh["dp"], 3, "fp32", "none", "blocks")
    report = materialize_weights(model, weights, "cpu")
    d, t = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    assert isinstance(model.blocks[0].attn.q.weight.placements[0], _StridedShard)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.device_mesh.ndim == 2, name
        module = name.split(".", 2)[-1].rpartition(".")[0]  # 'blocks.0.attn.q.weight' -> 'attn.q'
        tp_piece = expected[name]
        if name.startswith("blocks.") and module in ("attn.q", "attn.k", "attn.v", "mlp.up"):
            tp_piece = tp_piece.chunk(2, 0)[t]
        elif name.startswith("blocks.") and module in ("attn.o", "mlp.down") and name.endswith("weight"):
            tp_piece = tp_piece.chunk(2, 1)[t]
        assert torch.equal(param.to_local(), tp_piece.chunk(2, 0)[d]), (rank, name)
    assert report.shard_bytes <= model_bytes(expected) // 2
    print("ok")


@pytest.mark.parametrize("rank", [1, 2])  # (dp, tp) = (0, 1) and (1, 0)
def test_fsdp2_over_tensor_parallel_shards_are_the_hand_computed_slices(rank):
    code = f"import tests.unit.test_materialize as t; t.fake_world_rank({rank})"  # one world per process
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
