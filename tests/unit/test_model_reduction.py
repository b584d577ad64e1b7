"""Layer reduction and attention-head pruning (zplan.model_reduction) and the reduced model file.

Parameter counts of examples/tiny.py (h = 64, 4 heads of d = 16, V = 256, T = 64, 2 blocks, tied head):
  embeddings 256*64 + 64*64 = 20,480; final LayerNorm 128
  block: 2 LayerNorms 256, q/k/v/o 4 * (64*64 + 64) = 16,640, MLP (64*256 + 256) + (256*64 + 64) = 33,088 -> 49,984
  total 20,480 + 2 * 49,984 + 128 = 120,576
  one pruned head: q, k, v lose 16 rows and 16 biases each, o loses 16 columns: 3 * (16*64 + 16) + 64*16 = 4,144
"""

import copy
import importlib.util
import itertools
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import typer
from torch import nn
from typer.testing import CliRunner

from zplan.cli import app as zplan_app
from zplan.errors import ModelLoadError
from zplan.model.model_file import load_model_file
from zplan.model_reduction import (
    ReductionError,
    find_attention,
    head_importance,
    keep_layers,
    least_important_heads,
    mask_heads,
    prune_heads,
    write_reduced_model_file,
)
from zplan.reduce_cli import reduce_command

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.py"
TINY_PARAMS, BLOCK_PARAMS, HEAD_PARAMS = 120_576, 49_984, 4_144


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"reduction_test_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny = load_example("tiny")


def tiny_model(seed=0, **sizes):
    torch.manual_seed(seed)
    return tiny.build_model(**sizes)


def count(model):
    return sum(p.numel() for p in model.parameters())


def tokens(batch=2, seq=16, seed=1):
    return torch.randint(0, tiny.VOCAB_SIZE, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ---- layer reduction -------------------------------------------------------------------------------------


def test_keep_layers_keeps_the_chosen_teacher_layers_weights_in_order():
    teacher = tiny_model(num_layers=4)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student = keep_layers(teacher, "blocks", [3, 1])
    assert len(student.blocks) == 2 and isinstance(student.blocks, nn.ModuleList)
    after = student.state_dict()
    for new, old in ((0, 3), (1, 1)):
        names = [k for k in before if k.startswith(f"blocks.{old}.")]
        assert names
        for name in names:
            assert torch.equal(after[name.replace(f"blocks.{old}.", f"blocks.{new}.", 1)], before[name])
    for name in ("wte.weight", "wpe.weight", "ln_f.weight"):
        assert torch.equal(after[name], before[name])
    assert count(student) == TINY_PARAMS + 2 * BLOCK_PARAMS - 2 * BLOCK_PARAMS  # 4 blocks -> 2
    assert student(tokens()).shape == (2, 16, tiny.VOCAB_SIZE)


class Toy(nn.Module):
    """Blocks in an nn.Sequential or nn.ModuleDict, layer counts recorded on the model and its config."""

    def __init__(self, container="sequential", layers=3):
        super().__init__()
        linears = [nn.Linear(4, 4) for _ in range(layers)]
        self.body = nn.Module()
        self.body.blocks = (nn.Sequential(*linears) if container == "sequential"
                            else nn.ModuleDict({f"layer{i}": m for i, m in enumerate(linears)}))
        self.n_layers = layers
        self.hidden = layers  # an int equal to the layer count that is not a layer count: left alone
        self.config = SimpleNamespace(num_hidden_layers=layers, n_layer=layers)


@pytest.mark.parametrize("container", ["sequential", "dict"])
def test_keep_layers_on_sequential_and_dict_updates_the_layer_counts(container):
    model = Toy(container)
    weights = [m.weight.clone() for m in (model.body.blocks.values() if container == "dict" else model.body.blocks)]
    keep_layers(model, "body.blocks", [0, 2])
    kept = model.body.blocks
    if container == "dict":
        assert list(kept.keys()) == ["layer0", "layer2"]
        kept = list(kept.values())
    else:
        assert isinstance(kept, nn.Sequential)
    assert [torch.equal(m.weight, w) for m, w in zip(kept, [weights[0], weights[2]], strict=True)] == [True, True]
    assert (model.n_layers, model.config.num_hidden_layers, model.config.n_layer, model.hidden) == (2, 2, 2, 3)


@pytest.mark.parametrize("keep,needle", [([2], "out of range"), ([-1], "out of range"), ([], "at least one"),
                                         ([0, 0], "repeat"), ([0.5], "out of range")])
def test_bad_layer_indices_fail_clearly(keep, needle):
    model = tiny_model()
    with pytest.raises(ReductionError, match=needle):
        keep_layers(model, "blocks", keep)
    assert len(model.blocks) == 2  # unchanged


def test_bad_block_prefix_fails_clearly():
    with pytest.raises(ReductionError, match="no submodule 'layers'"):
        keep_layers(tiny_model(), "layers", [0])
    with pytest.raises(ReductionError, match="not a ModuleList"):
        keep_layers(tiny_model(), "ln_f", [0])


# ---- head pruning ----------------------------------------------------------------------------------------


def attention_with_heads_zeroed(attn, x, zeroed):
    """examples/tiny.py's Attention.forward written out, with the outputs of heads `zeroed` set to 0."""
    batch, seq, _ = x.shape
    q, k, v = (proj(x).view(batch, seq, -1, attn.head_dim).transpose(1, 2) for proj in (attn.q, attn.k, attn.v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, a, T, d)
    y[:, zeroed] = 0.0
    return attn.o(y.transpose(1, 2).reshape(batch, seq, -1))


def test_pruned_attention_equals_the_unpruned_one_with_those_heads_zeroed():
    model = tiny_model()
    attn = model.blocks[0].attn
    x = torch.randn(2, 16, tiny.HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = attention_with_heads_zeroed(attn, x, [1, 3])
        assert not torch.allclose(reference, attention_with_heads_zeroed(attn, x, []), atol=1e-4)
        prune_heads(model, {0: [3, 1]})
        torch.testing.assert_close(attn(x), reference, rtol=1e-5, atol=1e-6)
    assert (attn.q.weight.shape, attn.q.bias.shape, attn.o.weight.shape) == ((32, 64), (32,), (64, 32))
    assert (attn.q.out_features, attn.o.in_features, find_attention(model.blocks[0]).heads) == (32, 32, 2)


def test_pruned_model_equals_the_masked_model_with_the_hand_counted_parameters():
    model = tiny_model()
    idx = tokens()
    pruned = {0: [1, 3], 1: [0]}
    gates = torch.ones(2, tiny.HEADS)
    gates[0, [1, 3]] = 0.0
    gates[1, 0] = 0.0
    with torch.no_grad():
        with mask_heads(model, gates):
            masked = model(idx)
        assert not torch.allclose(masked, model(idx), atol=1e-4)  # the hooks are gone and they mattered
        student = prune_heads(copy.deepcopy(model), pruned)
        torch.testing.assert_close(student(idx), masked, rtol=1e-5, atol=1e-6)
    assert count(model) == TINY_PARAMS
    assert count(student) == TINY_PARAMS - 3 * HEAD_PARAMS == 108_144
    assert [find_attention(b).heads for b in student.blocks] == [2, 3]


def test_head_count_attribute_is_lowered():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_heads = 4  # no head_dim: the head size is q's width / n_heads
            self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    block = nn.Module()
    block.attn = Attn()
    model = nn.Module()
    model.blocks = nn.ModuleList([block])
    prune_heads(model, {0: [0]}, "blocks")
    assert (block.attn.n_heads, block.attn.q.weight.shape, block.attn.o.weight.shape) == (3, (6, 8), (8, 6))


@pytest.mark.parametrize("heads,needle", [({2: [0]}, "out of range"), ({0: [4]}, "0..3"), ({0: [1, 1]}, "once"),
                                          ({0: [0, 1, 2, 3]}, "leave none")])
def test_bad_head_choices_fail_clearly_and_change_nothing(heads, needle):
    model = tiny_model()
    with pytest.raises(ReductionError, match=needle):
        prune_heads(model, {1: [0], **heads})
    assert count(model) == TINY_PARAMS


class FusedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = 4
        self.qkv = nn.Linear(8, 24)
        self.o = nn.Linear(8, 8)


class NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(8, 8)


class TwoMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)


@pytest.mark.parametrize("block,needle", [(FusedAttention(), "fused q/k/v"), (NoAttention(), "not supported"),
                                          (TwoMHA(), "MultiheadAttention")])
def test_unknown_attention_layouts_fail_clearly(block, needle):
    model = nn.Module()
    model.blocks = nn.ModuleList([block])
    with pytest.raises(ReductionError, match=needle):
        prune_heads(model, {0: [0]}, "blocks")


def test_grouped_query_attention_fails_clearly():
    llama = load_example("llama")
    model = llama.build_model(num_layers=1, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=100)
    with pytest.raises(ReductionError, match="grouped-query"):
        prune_heads(model, {0: [0]}, "layers")


# ---- head importance -------------------------------------------------------------------------------------


def test_head_importance_ranks_a_head_with_zero_output_weights_least():
    model = tiny_model()
    with torch.no_grad():
        model.blocks[0].attn.o.weight[:, 2 * 16:3 * 16] = 0.0  # head 2 of layer 0 reaches nothing
    batches = list(itertools.islice(tiny.train_data(4, 32, seed=0), 3))
    flags = [p.requires_grad for p in model.parameters()]
    scores = head_importance(model, batches)
    assert scores.shape == (2, 4)
    assert scores[0, 2] == 0.0 and bool((scores[0, [0, 1, 3]] > 0).all()) and bool((scores[1] > 0).all())
    assert least_important_heads(scores, 1)[0] == [2]
    assert model.training and [p.requires_grad for p in model.parameters()] == flags
    normalized = head_importance(model, batches, normalize=True)
    torch.testing.assert_close(normalized.norm(dim=1), torch.ones(2))


def test_head_importance_is_the_gradient_through_the_heads_output_slice():
    """|dL/d gate_h| = |sum over head h's slice of o's input x of x * dL/dx| (Michel et al. 2019, sec. 4.1)."""
    model = tiny_model().eval()
    batch = next(tiny.train_data(4, 32, seed=5))
    captured = {}

    def keep_input(module, args):
        args[0].retain_grad()
        captured["x"] = args[0]

    handle = model.blocks[1].attn.o.register_forward_pre_hook(keep_input)
    logits = model(batch)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten()).backward()
    handle.remove()
    x = captured["x"]  # (B, T, heads * d)
    expected = (x * x.grad).detach().unflatten(-1, (4, 16)).sum(dim=(0, 1, 3)).abs()  # (heads,)
    model.zero_grad()
    torch.testing.assert_close(head_importance(model, [batch])[1], expected, rtol=1e-4, atol=1e-9)


# ---- the reduced model file ------------------------------------------------------------------------------


def test_written_file_builds_the_reduced_teacher_compiles_and_is_deterministic(tmp_path):
    out = tmp_path / "small.py"
    result = write_reduced_model_file(TINY, out, keep_layers=[1], prune={"heads_per_layer": 2})
    first = out.read_text()
    write_reduced_model_file(TINY, tmp_path / "again.py", keep_layers=[1], prune={"heads_per_layer": 2})
    assert (tmp_path / "again.py").read_text() == first
    assert "KEEP_LAYERS = [1]" in first and f"PRUNE_HEADS = {result.prune!r}" in first
    assert len(result.prune[0]) == 2 and (result.params_before, result.params_after) == (TINY_PARAMS, 62_304)

    student_file = load_model_file(out)
    assert (student_file.seq_len, student_file.user_train_data) == (tiny.SEQ_LEN, student_file.module.train_data)
    torch.manual_seed(0)
    student = student_file.build()
    teacher = tiny_model(0)
    assert count(student) == TINY_PARAMS - BLOCK_PARAMS - 2 * HEAD_PARAMS == 62_304
    assert torch.equal(student.blocks[0].mlp.up.weight, teacher.blocks[1].mlp.up.weight)  # teacher layer 1
    kept = [h for h in range(4) if h not in result.prune[0]]
    rows = torch.cat([teacher.blocks[1].attn.v.weight[16 * h:16 * (h + 1)] for h in kept])
    assert torch.equal(student.blocks[0].attn.v.weight, rows)

    plan_dir = tmp_path / "plan"
    compiled = CliRunner().invoke(zplan_app, ["compile", str(out), "--gpus", "2", "--cluster", "cpu-local",
                                              "--global-batch", "8", "--seq", "64", "--precision", "fp32",
                                              "-o", str(plan_dir), "--json"])
    assert compiled.exit_code == 0, compiled.output
    summary = json.loads((plan_dir / "plan.json").read_text())["model"]
    assert (summary["params"], summary["num_blocks"], summary["heads"]) == (62_304, 1, 2)


def test_written_file_loads_teacher_weights_except_on_meta(tmp_path):
    teacher = tiny_model(seed=7)
    torch.save(teacher.state_dict(), tmp_path / "teacher.pt")
    out = tmp_path / "sub" / "student.py"
    write_reduced_model_file(TINY, out, keep_layers=[0], prune={0: [3]}, weights=tmp_path / "teacher.pt")
    assert "WEIGHTS = '../teacher.pt'" in out.read_text()
    student = load_model_file(out).build()
    assert torch.equal(student.blocks[0].attn.o.weight, teacher.blocks[0].attn.o.weight[:, :48])
    assert torch.equal(student.wte.weight, teacher.wte.weight)
    (tmp_path / "teacher.pt").unlink()
    assert count(load_model_file(out).build("meta")) == TINY_PARAMS - BLOCK_PARAMS - HEAD_PARAMS  # not read
    with pytest.raises(ModelLoadError, match="teacher weights .* do not exist"):
        load_model_file(out).build()


@pytest.mark.parametrize("kwargs,needle", [({"keep_layers": [5]}, "out of range"),
                                           ({"prune": {"heads_per_layer": 4}}, "between 1 and 3"),
                                           ({"prune": {"wrong": 1}}, "must be None"),
                                           ({"prune": {0: [9]}}, "0..3"),
                                           ({"weights": "absent.pt"}, "do not exist"),
                                           ({"prune": {"heads_per_layer": 1}, "block_prefix": "ln_f"}, "not a Module")])
def test_write_fails_clearly_and_writes_nothing(tmp_path, kwargs, needle):
    out = tmp_path / "small.py"
    with pytest.raises(ReductionError, match=needle):
        write_reduced_model_file(TINY, out, **kwargs)
    assert not out.exists()


def test_write_checks_the_attention_layout_on_meta_before_building_on_the_cpu(tmp_path):
    teacher = tmp_path / "fused.py"
    teacher.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv, self.o = nn.Linear(8, 24), nn.Linear(8, 8)

        def build_model():
            if torch.empty(0).device.type != "meta":
                raise RuntimeError("a large teacher: built on the CPU")
            model = nn.Module()
            model.emb = nn.Embedding(10, 8)
            model.blocks = nn.ModuleList(Block() for _ in range(2))
            return model
        """))
    with pytest.raises(ReductionError, match="fused q/k/v"):
        write_reduced_model_file(teacher, tmp_path / "small.py", prune={"heads_per_layer": 1})


def test_reduce_command(tmp_path):
    app = typer.Typer()
    app.command("reduce")(reduce_command)
    app.callback()(lambda: None)  # a command group, as zplan's app is
    out = tmp_path / "small.py"
    result = CliRunner().invoke(app, ["reduce", str(TINY), "--keep-layers", "0", "--prune-heads", "1",
                                      "--calibration-batches", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "120,576 -> 66,448" in " ".join(result.output.split())  # 120,576 - 49,984 - 4,144
    assert count(load_model_file(out).build("meta")) == 66_448
    for bad, needle in (("a,b", "commas"), ("0,7", "out of range")):
        failed = CliRunner().invoke(app, ["reduce", str(TINY), "--keep-layers", bad, "-o", str(tmp_path / "x.py")])
        assert failed.exit_code == 2 and needle in failed.output and "Traceback" not in failed.output
    assert not (tmp_path / "x.py").exists()
