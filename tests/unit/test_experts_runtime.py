"""zplan's experts executor (runtime/parallel/experts.py) at ep = 1: against each MoE family's own forward
(transformers' eager loop, examples/moe.py's loop), on fake tensors with balanced counts, and its refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zplan.examples.moe as example_moe
from zplan.errors import PlanMismatchError
from zplan.model.experts import find_expert_layers
from zplan.runtime.dryrun.fake_world import fake_tensors
from zplan.runtime.parallel.expert_dispatch import balanced_counts
from zplan.runtime.parallel.experts import ZplanExperts, apply_experts, experts_math

transformers = pytest.importorskip("transformers")

VOCAB, BATCHES = 64, 3
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, use_cache=False, attention_dropout=0.0)


def _configs():
    t = transformers
    return {
        "mixtral": t.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                   router_jitter_noise=0.0),
        "qwen3_moe": t.Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=24, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                      norm_topk_prob=True),
        "qwen2_moe": t.Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
        "deepseek_v3": t.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=64,
                                          moe_intermediate_size=24, n_shared_experts=1, n_routed_experts=8,
                                          num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=16,
                                          kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                          n_group=2, topk_group=1),
        "olmoe": t.OlmoeConfig(**COMMON, intermediate_size=24, num_experts=4, num_experts_per_tok=2),
        "gpt_oss": t.GptOssConfig(**COMMON, intermediate_size=24, head_dim=8, num_local_experts=4,
                                  num_experts_per_tok=2, swiglu_limit=0.3),  # a low limit: the clamps act
    }


def build_hf(name: str) -> nn.Module:
    torch.manual_seed(0)
    return hf_model(name)


def hf_model(name: str) -> nn.Module:
    """A tiny fp32 model of family `name` running transformers' own experts loop, its parameters random (the
    experts' biases and the routers too, so that every term of the math shows)."""
    attention = "eager" if name == "gpt_oss" else "sdpa"  # GPT-OSS has no sdpa path (attention sinks)
    model = transformers.AutoModelForCausalLM.from_config(_configs()[name], attn_implementation=attention,
                                                          experts_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:  # matrices, stacked experts and their biases (E, n)
                param.normal_(0.0, 0.2)
    return model


def logits_and_grads(model: nn.Module, tokens: torch.Tensor, hf: bool) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=tokens).logits if hf else model(tokens)  # (B, T, V)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_same_as_own_forward(model: nn.Module, hf: bool) -> None:
    """Logits and every gradient with zplan's executor against the model's own experts forward, a few batches."""
    batches = [torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(b)) for b in range(BATCHES)]
    own = [logits_and_grads(model, tokens, hf) for tokens in batches]
    layers = apply_experts(model)
    assert layers and all(isinstance(model.get_submodule(layer.path), ZplanExperts) for layer in layers)
    for tokens, (own_logits, own_grads) in zip(batches, own, strict=True):
        logits, grads = logits_and_grads(model, tokens, hf)
        assert (logits - own_logits).abs().max().item() <= 1e-5
        assert grads.keys() == own_grads.keys()
        for name, grad in grads.items():
            assert (grad - own_grads[name]).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "olmoe", "gpt_oss"])
def test_transformers_families_compute_as_their_own_forward(name):
    assert_same_as_own_forward(build_hf(name), hf=True)


def build_example(**sizes) -> nn.Module:
    torch.manual_seed(0)
    return example_model(**sizes)


def example_model(**sizes) -> nn.Module:
    return example_moe.build_model(**{**dict(num_layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=24,
                                             num_experts=4, top_k=2, vocab_size=VOCAB), **sizes})


def test_example_moe_computes_as_its_own_forward():
    assert_same_as_own_forward(build_example(), hf=False)


def test_the_model_prints_and_saves_as_before():
    model = build_hf("mixtral")
    names, text = list(model.state_dict()), repr(model)
    apply_experts(model)
    apply_experts(model)  # twice: the same
    assert list(model.state_dict()) == names and repr(model) == text
    assert [layer.path for layer in find_expert_layers(model)] == [f"model.layers.{i}.mlp.experts" for i in range(2)]


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])  # (E, 2F, h) chunked; (E, h, 2F) interleaved with biases
def test_grouped_mm_computes_as_the_loop(name, monkeypatch):
    """The GPU's path (one grouped_mm per projection) against the loop, bf16 forward on the CPU (whose grouped_mm has
    a forward but no backward): the same numbers up to bf16 rounding."""
    import zplan.runtime.parallel.experts as executor

    model = build_hf(name).to(torch.bfloat16)
    apply_experts(model)
    experts = model.model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(13, 32, generator=generator).to(torch.bfloat16)  # (T, h)
    index = torch.randint(0, 3, (13, 2), generator=generator)  # (T, k): the last of the 4 experts gets no token
    weights = torch.rand(13, 2, generator=generator).to(torch.bfloat16)  # (T, k)
    with torch.no_grad():
        loop = experts(hidden, index, weights)
        monkeypatch.setattr(executor, "_use_grouped_mm", lambda *tensors: True)
        grouped = experts(hidden, index, weights)
    assert grouped.dtype == torch.bfloat16 and grouped.shape == (13, 32)
    assert (grouped.float() - loop.float()).abs().max().item() <= 2e-2 * loop.float().abs().max().item()


# ---- fake tensors (the dry run) ---------------------------------------------------------------------------


class _RecordMatmuls(TorchDispatchMode):
    """The shapes of every mm and grouped_mm that runs."""

    def __init__(self):
        super().__init__()
        self.mm: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.grouped: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.mm.append((tuple(args[0].shape), tuple(args[1].shape)))
        if func is torch.ops.aten._grouped_mm.default:
            self.grouped.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_tensors_run_balanced_counts(dtype):
    """Forward + backward of examples/moe.py on the dry run's fake tensors: 2 x 7 tokens x top-2 = 28 routed copies
    over 8 experts run as [4, 4, 4, 4, 3, 3, 3, 3] (fp32: the loop, one mm per expert) or one grouped_mm per
    projection (bf16, as on a GPU); every expert weight gets its gradient."""
    hidden, ffn, experts = 32, 24, 8
    with torch.device("meta"):
        model = build_example(num_layers=1, ffn_hidden=ffn, num_experts=experts).to(dtype)
    apply_experts(model)
    recorder = _RecordMatmuls()
    with fake_tensors():
        model.to_empty(device="cpu")
        tokens = torch.zeros(2, 7, dtype=torch.long)
        with recorder:
            model(tokens).float().square().mean().backward()
        gate_up = model.layers[0].mlp.experts.gate_up_proj
        assert gate_up.grad is not None and gate_up.grad.shape == (experts, 2 * ffn, hidden)
    expected = balanced_counts(28, experts)
    assert expected == [4, 4, 4, 4, 3, 3, 3, 3]
    gate_up_rows = [a[0] for a, b in recorder.mm if b == (hidden, 2 * ffn)]  # forward: x (n, h) @ W^T (h, 2F)
    if dtype == torch.float32:
        assert gate_up_rows == expected and not recorder.grouped
    else:
        assert not gate_up_rows
        assert recorder.grouped[:2] == [(28, hidden), (28, ffn)]  # gate_up, then down
        assert len(recorder.grouped) >= 2 + 4  # and the backward's: each projection's input and weight gradients


def test_expert_parallel_on_a_fake_rank():
    """Rank 1 of ep = 2 in the dry run's fake world (nothing exchanged, every rank taken to route as this one): it
    holds experts 4..7 and runs on each the 3 + 3 balanced copies of both ranks' 28; its gradient is its shard."""
    from torch.distributed.device_mesh import init_device_mesh

    from zplan.runtime.dryrun.fake_world import fake_world

    hidden, ffn = 32, 24
    recorder = _RecordMatmuls()
    with fake_world(rank=1, world_size=2):
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            model = build_example(num_layers=1, ffn_hidden=ffn, num_experts=8)
        apply_experts(model, mesh)
        with fake_tensors():
            model.to_empty(device="cpu")
            with recorder:
                model(torch.zeros(2, 7, dtype=torch.long)).square().mean().backward()
            grad = model.layers[0].mlp.experts.gate_up_proj.grad
            assert grad.shape == (8, 2 * ffn, hidden) and grad.to_local().shape == (4, 2 * ffn, hidden)
    assert [a[0] for a, b in recorder.mm if b == (hidden, 2 * ffn)] == [6, 6, 6, 6]


def test_balanced_counts_spread_the_remainder():
    assert balanced_counts(10, 4) == [3, 3, 2, 2] and balanced_counts(8, 4) == [2] * 4 and balanced_counts(1, 3) == [
        1, 0, 0]


# ---- refusals ---------------------------------------------------------------------------------------------


class _UnknownExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(4, 16, 8))
        self.w2 = nn.Parameter(torch.zeros(4, 8, 16))

    def forward(self, x, top_k_index, top_k_weights):
        return x


class _UnknownMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.gate.top_k = 2
        self.experts = _UnknownExperts()


def test_unknown_experts_keep_their_forward_at_ep1_and_expert_parallel_refuses_them():
    model = _UnknownMoE()
    assert apply_experts(model) == [] and type(model.experts) is _UnknownExperts  # runs as the model has it
    with pytest.raises(PlanMismatchError, match=r"experts \(_UnknownExperts\): it holds stacked experts, but zplan"):
        experts_math(model.experts, "experts")  # what apply_experts(model, ep_mesh) raises under ep > 1


def test_transformers_experts_without_a_gate_are_refused():
    model = build_hf("olmoe")
    experts = model.model.layers[1].mlp.experts
    experts.has_gate = False
    with pytest.raises(PlanMismatchError, match=r"layers\.1\.mlp\.experts \(OlmoeExperts\).*have no gate"):
        experts_math(experts, "model.layers.1.mlp.experts")
    assert [layer.path for layer in apply_experts(model)] == ["model.layers.0.mlp.experts"]  # its own forward


def test_zero3_shards_stacked_experts_evenly_over_more_ranks_than_experts():
    """FSDP2 shards dim 0 by default: 8 stacked experts over 64 ranks would give rank 0 a whole expert and 56 ranks
    nothing (a Mixtral-8x7B dry run at dp 64 measured 171.7 GiB against 29.2 planned); the longest other dim is
    sharded instead, 1 / 64 a rank."""
    from torch.distributed.tensor import Shard

    from zplan.runtime.parallel.data_parallel import _evenly_sharded_dim

    placement = _evenly_sharded_dim(64)
    assert placement(nn.Parameter(torch.empty(8, 28672, 4096))) == Shard(1)  # Mixtral's gate_up (E, 2F, h)
    assert placement(nn.Parameter(torch.empty(8, 4096, 14336))) == Shard(2)  # down (E, h, F)
    assert placement(nn.Parameter(torch.empty(128, 64))) is None  # dim 0 long enough: FSDP2's Shard(0)
    assert placement(nn.Parameter(torch.empty(8))) is None and placement(nn.Parameter(torch.empty(8, 4))) is None


def test_zero3_under_expert_parallel_shards_each_ranks_own_experts_evenly():
    """Under ep = 8 a rank holds 1 of Mixtral's 8 experts (a Shard(0) DTensor whose local tensor FSDP2 shards over the
    edp ranks): that one row over 8 edp ranks would go whole to one of them (a Mixtral-8x7B dry run at ep 8 x edp 8,
    ZeRO-3, measured 90.8 GiB against 15.5 planned), so its longest dim is sharded; the global 8 rows decide nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from zplan.runtime.dryrun.fake_world import fake_world
    from zplan.runtime.parallel.data_parallel import _evenly_sharded_dim

    with fake_world(rank=0, world_size=8):
        ep_mesh = init_device_mesh("cpu", (8,))
        gate_up = distribute_tensor(torch.empty(8, 56, 32, device="meta"), ep_mesh, [Shard(0)], src_data_rank=None)
        assert gate_up.to_local().shape == (1, 56, 32)
        assert _evenly_sharded_dim(8)(nn.Parameter(gate_up)) == Shard(1)
        assert _evenly_sharded_dim(1)(nn.Parameter(gate_up)) is None  # one edp rank: FSDP2's Shard(0)
