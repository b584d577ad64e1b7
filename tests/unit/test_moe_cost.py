"""Mixture-of-experts pricing against hand computations: experts whole under tp and split by ep, their states sharded
over dp / ep, the all-to-alls, and the --ep pin's checks."""

from pathlib import Path

import numpy as np
import pytest

import zplan.examples
from zplan.errors import SpecError
from zplan.model_input import trace_model_file
from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost.comm import all_to_all_s
from zplan.planner.cost.inputs import Candidates, ModelNumbers
from zplan.planner.cost.memory import memory_per_gpu
from zplan.planner.cost.step import estimate_step
from zplan.schemas.spec import Pins

H100 = BUILTIN_CLUSTERS["dgx-h100"].without_host()  # the device's terms alone
L, S, H, E, K, F = 8, 1024, 1024, 8, 2, 2048  # blocks, tokens, hidden, experts, top-k, expert width
EXPERTS = E * 3 * H * F  # one block's routed experts' parameters
DENSE = 4 * H * H  # one block's attention
EXAMPLES = Path(zplan.examples.__file__).parent


def moe_numbers() -> ModelNumbers:
    return ModelNumbers(num_blocks=L, hidden=H, heads=8, ffn_hidden=F, vocab=32000, seq_len=S,
                        params=L * (DENSE + EXPERTS), embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0,
                        head_fwd_flops=0.0, block_params=DENSE + EXPERTS,
                        block_fwd_flops=2.0 * S * (DENSE + K * 3 * H * F), block_act_bytes=34.0 * S * H,
                        embed_act_bytes=0.0, head_act_bytes=0.0, block_expert_params=EXPERTS,
                        block_expert_fwd_flops=2.0 * S * K * 3 * H * F, num_experts=E, top_k=K, expert_ffn_hidden=F,
                        moe_blocks=L)


def one(**values) -> Candidates:
    base = dict(tp=1, pp=1, dp=8, micro_batch=1, zero=0, recompute=0, sp=0, interleave=1, offload=0, ep=1)
    return Candidates.single(**{**base, **values})


def states(cand: Candidates, precision: str = "fp32") -> float:
    memory = memory_per_gpu(moe_numbers(), cand, H100, precision, num_micro_batches=np.array([1]))
    return float(memory.parameters[0] + memory.gradients[0] + memory.optimizer[0])


def test_zero0_holds_its_ep_share_of_the_experts_and_every_tp_rank_holds_them_whole():
    # fp32 ZeRO 0: 4 + 4 + 8 bytes a parameter, all of them on the GPU
    assert states(one(ep=1)) == pytest.approx(16 * L * (DENSE + EXPERTS))
    assert states(one(ep=4)) == pytest.approx(16 * L * (DENSE + EXPERTS / 4))
    # tp splits the Linears only: the experts stay whole on each of the 2 tp ranks
    assert states(one(tp=2, dp=4)) == pytest.approx(16 * L * (DENSE / 2 + EXPERTS))


def test_zero3_shards_the_experts_over_the_ranks_that_hold_them_so_ep_changes_nothing_at_rest():
    # ZeRO 3: everything sharded; the dense part over dp = 8, the experts (E / ep each) over dp / ep
    for ep in (1, 2, 8):
        assert states(one(zero=3, ep=ep)) == pytest.approx(16 * L * (DENSE + EXPERTS) / 8)


def test_zero1_shards_the_optimizer_over_dp_and_keeps_the_expert_weights_split_by_ep():
    # bf16 ZeRO 1: 16-bit weights and gradients (2 + 2) whole, fp32 master + m + v (12) over the group
    got = states(one(zero=1, ep=4), "bf16")
    assert got == pytest.approx(L * (4 * DENSE + 12 * DENSE / 8 + 4 * EXPERTS / 4 + 12 * (EXPERTS / 4) / (8 / 4)))


def test_all_to_alls_are_four_a_moe_block_and_six_under_full_recompute():
    model = moe_numbers()
    routed = 1 * S * K * H * 2  # (b s k, h) bf16 bytes a micro-batch
    for recompute, exchanges in ((0, 4), (2, 6)):
        cand = one(ep=8, recompute=recompute)
        est = estimate_step(model, cand, H100, "bf16", global_batch=8)
        a2a = all_to_all_s(np.array([routed]), np.array([8]), np.array([1]), H100)[0]
        assert est.expert_parallel_s[0] == pytest.approx(L * exchanges * a2a)
        assert est.step_time_s[0] > est.compute_s[0] + est.expert_parallel_s[0]
    assert estimate_step(model, one(ep=1), H100, "bf16", global_batch=8).expert_parallel_s[0] == 0.0


def test_per_node_dispatch_sends_a_token_once_to_each_other_node_it_visits():
    """ExpertsSummary.dispatch "per_node" (HybridEP / DeepEP): ep 16 over two 8-GPU nodes, 128 experts, top-8. A
    token visits the other node unless all 8 experts are among this node's 64: 1 - C(64, 8) / C(128, 8) of a copy
    crosses the inter-node link where all_to_all sends 8 / 16 of its 8 copies there; every copy bound for another
    rank crosses NVLink once. By hand against comm's links."""
    from dataclasses import replace
    from math import comb

    from zplan.planner.cost.step import remote_nodes_visited

    experts, top_k, ep = 128, 8, 16
    model = replace(moe_numbers(), num_experts=experts, top_k=top_k)
    per_node = replace(model, dispatch_per_node=True)
    visited = 1 - comb(64, 8) / comb(128, 8)
    assert remote_nodes_visited(model, np.array([ep]), np.array([1]), H100)[0] == pytest.approx(visited)
    assert remote_nodes_visited(model, np.array([8]), np.array([1]), H100)[0] == 0.0  # one node: none
    cand = one(ep=ep, dp=16)
    token = S * H * 2  # one copy of a micro-batch's tokens, bf16 bytes
    intra = 15 / 16 * top_k * token / (H100.intra_node_bandwidth_Bps * H100.efficiency.intra_node_link) \
        + 7 * H100.intra_node_latency_s
    inter_bw = H100.inter_node_bandwidth_Bps * H100.efficiency.inter_node_link
    inter = visited * token / inter_bw + H100.inter_node_latency_s
    est = estimate_step(per_node, cand, H100, "bf16", global_batch=16)
    assert est.expert_parallel_s[0] == pytest.approx(L * 4 * (intra + inter))
    plain = estimate_step(model, cand, H100, "bf16", global_batch=16).expert_parallel_s[0]
    assert plain == pytest.approx(L * 4 * all_to_all_s(np.array([top_k * token]), np.array([ep]), np.array([1]),
                                                       H100)[0])
    assert est.expert_parallel_s[0] < plain  # about 1 copy a token over the inter-node link, against 4


@pytest.fixture(scope="module")
def tiny_moe():
    return trace_model_file(EXAMPLES / "moe.py", 64, "bf16", build_overrides=dict(
        num_layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, num_experts=4, top_k=2, vocab_size=128))[1]


def test_the_ep_pin_is_priced_and_runs_with_every_zero_stage(tiny_moe):
    from zplan.api import Request, compile_with_alternatives
    from zplan.runtime.plan.check import runtime_gaps
    from zplan.schemas.spec import TrainSpec

    def plan_for(zero):
        request = Request("moe.py", tiny_moe, H100, 8, TrainSpec(global_batch=16, seq_len=64, precision="bf16"),
                          Pins(ep=4, tp=1, pp=1, zero=zero), "auto")
        return compile_with_alternatives(request)[0]

    plans = [plan_for(zero) for zero in range(4)]
    assert all((plan.parallel.ep, plan.parallel.dp) == (4, 8) for plan in plans)
    assert all(plan.prediction.time.expert_parallel > 0 and runtime_gaps(plan) == [] for plan in plans)
    # ZeRO-3 by hand: every parameter 1/8 a rank, the others over dp = 8, each rank's 4 / ep = 1 experts over the 2
    # edp ranks that hold them; fp32 shards (4 bytes) and m and v (8), as the plan's placement reports them
    memory = plans[3].prediction.memory
    assert memory.parameters == memory.gradients == pytest.approx(4 * tiny_moe.params / 8)
    assert memory.optimizer == pytest.approx(8 * tiny_moe.params / 8)


@pytest.mark.parametrize("ep, words", [(3, "ep divides the 4 routed experts"), (16, "ep divides the 4 routed")])
def test_an_ep_that_does_not_divide_the_experts_is_refused_with_the_rule(tiny_moe, ep, words):
    from zplan.api import Request, compile_with_alternatives
    from zplan.schemas.spec import TrainSpec

    request = Request("moe.py", tiny_moe, H100, 48, TrainSpec(global_batch=48, seq_len=64, precision="bf16"),
                      Pins(ep=ep), "auto")
    with pytest.raises(SpecError, match=words):
        compile_with_alternatives(request)


def test_ep_on_a_dense_model_is_refused():
    from zplan.api import compile_with_alternatives, prepare

    request = prepare(str(EXAMPLES / "tiny.py"), 8, "dgx-h100", 16, None, "bf16", Pins(ep=2))
    with pytest.raises(SpecError, match="ep > 1 needs a mixture of experts"):
        compile_with_alternatives(request)


def test_routing_imbalance_slows_the_busiest_expert_parallel_rank_only():
    """--moe-imbalance F: under ep > 1 the busiest rank computes and receives F times the mean routed tokens; at
    ep = 1 every rank runs all experts on its own tokens, so nothing changes."""
    from dataclasses import replace

    from zplan.planner.cost.compute import block_time_s

    balanced, skewed = moe_numbers(), replace(moe_numbers(), routing_imbalance=1.5)
    for ep in (1, 8):
        cand = one(ep=ep)
        skewed_step = estimate_step(skewed, cand, H100, "bf16", global_batch=8)
        busiest = 1.5 * S * K * H * 2  # the busiest rank's (b s k, h) bf16 bytes
        a2a = all_to_all_s(np.array([busiest]), np.array([ep]), np.array([1]), H100)[0]
        assert skewed_step.expert_parallel_s[0] == pytest.approx(L * 4 * a2a)  # 0 at ep = 1
        slower = block_time_s(skewed, cand, H100, "bf16")[0] - block_time_s(balanced, cand, H100, "bf16")[0]
        assert (slower > 0) == (ep > 1)


def test_experts_at_the_gemm_peak_save_their_flops_at_the_bf16_peak_less_those_at_the_fp8_peak():
    """ExpertsSummary.at_gemm_peak (a stack whose grouped GEMM runs the experts in fp8): the experts' forward + backward
    FLOPs move from the bf16 peak to the fp8 peak, at the efficiency of a GEMM whose half point is as much larger as
    the peak (the same fixed time at that rate), and nothing else in the block changes; under bf16 the flag changes
    nothing (both peaks are bf16's)."""
    from dataclasses import replace

    from zplan.planner.cost.compute import block_time_s, gemm_efficiency

    cand = one(ep=8)
    as_linears, at_peak = moe_numbers(), replace(moe_numbers(), experts_at_gemm_peak=True)
    expert_tokens = S * K * 8 / E  # one expert's share of the tokens of the 8 ep ranks
    x = np.array([2.0 * expert_tokens * H * F])
    speedup = H100.gpu.peak_fp8_flops / H100.gpu.peak_bf16_flops
    eff, eff_fp8 = gemm_efficiency(x, H100)[0], gemm_efficiency(x, H100, speedup)[0]
    flops = 3.0 * 2.0 * S * K * 3 * H * F  # forward + backward of the routed experts, one sample
    saved = flops / eff / H100.gpu.peak_bf16_flops - flops / eff_fp8 / H100.gpu.peak_fp8_flops
    fp8_gain = block_time_s(as_linears, cand, H100, "fp8")[0] - block_time_s(at_peak, cand, H100, "fp8")[0]
    assert fp8_gain == pytest.approx(saved)
    bf16 = block_time_s(as_linears, cand, H100, "bf16")[0]
    assert block_time_s(at_peak, cand, H100, "bf16")[0] == pytest.approx(bf16)


@pytest.mark.parametrize("value, words", [(0.5, "outside 1 \\(balanced\\) .. 2"), (3.0, "outside 1")])
def test_an_imbalance_out_of_range_is_refused(tiny_moe, value, words):
    from zplan.api import with_routing_imbalance

    with pytest.raises(SpecError, match=words):
        with_routing_imbalance(tiny_moe, value)
    assert with_routing_imbalance(tiny_moe, 1.25).experts.imbalance == 1.25


def test_the_report_states_the_routing_assumed(tiny_moe):
    from zplan.api import with_routing_imbalance
    from zplan.planner.assumptions import assumptions
    from zplan.schemas.spec import TrainSpec

    train = TrainSpec(global_batch=16, seq_len=64, precision="bf16")
    rows = {a.name: a.value for a in assumptions(H100, tiny_moe, train)}
    assert "evenly (balanced, dropless" in rows["routing"]
    rows = {a.name: a.value for a in assumptions(H100, with_routing_imbalance(tiny_moe, 1.5), train)}
    assert "busiest expert-parallel rank gets 1.5x" in rows["routing"]


UNKNOWN_EXPERTS_MODEL = '''"""Stacked experts beside a router with a top-k, declaring nothing of their math."""
import torch
from torch import nn

VOCAB_SIZE, SEQ_LEN = 64, 32


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 16, 8) * 0.02)
        self.w2 = nn.Parameter(torch.randn(4, 8, 16) * 0.02)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(4):
            weight = (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True)
            out = out + weight * (torch.relu(x @ self.w1[e].T) @ self.w2[e].T)
        return out


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.gate.top_k = 2
        self.experts = Experts()

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, index = torch.topk(self.gate(flat).softmax(-1), 2)
        return self.experts(flat, index, weights).reshape(x.shape)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(8), MoE()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, 8)
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(8, VOCAB_SIZE)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def build_model():
    return Model()
'''


def test_ep_on_experts_the_runtime_cannot_dispatch_is_refused_at_compile(tmp_path):
    """Experts whose math zplan's executor cannot tell run as the model has them (ep 1 plans), and --ep 2 is refused
    at compile naming the module and why: exit status 2, nothing written."""
    from typer.testing import CliRunner

    from zplan.cli import app

    model = tmp_path / "unknown_experts.py"
    model.write_text(UNKNOWN_EXPERTS_MODEL)
    args = ["compile", str(model), "--gpus", "4", "--cluster", "cpu-local", "--global-batch", "8"]
    refused = CliRunner().invoke(app, [*args, "--ep", "2", "-o", str(tmp_path / "ep2")])
    text = " ".join(refused.output.split())
    assert refused.exit_code == 2 and "Traceback" not in refused.output, refused.output
    assert "--ep: the runtime cannot run expert parallel on this model: layers.0.mlp.experts (Experts:" in text
    assert "cannot tell what its forward computes" in text and "use --ep 1" in text
    assert not (tmp_path / "ep2").exists()
    planned = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "auto")])
    assert planned.exit_code == 0, planned.output
    assert '"ep": 1' in (tmp_path / "auto" / "plan.json").read_text()
