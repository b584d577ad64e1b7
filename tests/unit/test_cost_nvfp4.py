"""nvfp4 training's cost terms against hand computations (planner/cost/compute.py, memory.py), its profiles, and what
compile and train.py refuse."""

import numpy as np
import pytest

from zplan.api import compile_plan, compile_with_alternatives, prepare
from zplan.errors import SpecError
from zplan.estimate_api import estimate_config
from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost.compute import activation_ops_Bps, block_time_s, edge_time_s, gemm_efficiency
from zplan.planner.cost.inputs import Candidates, ModelNumbers
from zplan.planner.cost.memory import memory_per_gpu
from zplan.planner.cost.step import estimate_step
from zplan.schemas.spec import Pins

B200 = BUILTIN_CLUSTERS["dgx-b200"].without_host()  # the device's terms alone
S, H, V, B = 2048, 1024, 32000, 2
LLAMA = "llama:layers=8,hidden=2048,heads=16,kv_heads=16,ffn=8192,seq=2048,vocab=32000"


def model() -> ModelNumbers:
    block_flops = 24.0 * S * H * H + 2.0 * S * S * H  # projections + causal QK^T and AV, one sample
    return ModelNumbers(num_blocks=4, hidden=H, heads=8, ffn_hidden=4 * H, vocab=V, seq_len=S, params=0.0,
                        embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0, head_fwd_flops=2.0 * S * H * V,
                        block_params=12.0 * H * H, block_fwd_flops=block_flops, block_act_bytes=30.0 * S * H,
                        embed_act_bytes=0.0, head_act_bytes=0.0)


def one(recompute=0, tp=1):
    return Candidates.single(tp=tp, pp=1, dp=1, micro_batch=B, zero=0, recompute=recompute, sp=0, interleave=1,
                             offload=0)


def test_blackwell_profiles_have_the_data_sheets_dense_fp4_peak():
    """Per GPU, dense: DGX B200 144 PFLOP/s sparse a node / 8 / 2; GB200 NVL72 1,440 PFLOP/s sparse a rack / 72 / 2;
    GB300 NVL72 1,080 PFLOP/s dense a rack / 72. Hopper and older have none."""
    peaks = {name: BUILTIN_CLUSTERS[name].gemm_peak_flops("nvfp4") for name in ("dgx-b200", "gb200-nvl72",
                                                                                 "gb300-nvl72")}
    assert peaks == {"dgx-b200": 144e15 / 8 / 2, "gb200-nvl72": 1440e15 / 72 / 2, "gb300-nvl72": 1080e15 / 72}
    assert [BUILTIN_CLUSTERS[name].gpu.peak_fp4_flops for name in ("dgx-h100", "dgx-a100-80g", "l40s-8")] == [0] * 3
    assert B200.peak_flops("nvfp4") == B200.peak_flops("bf16") == 2250e12  # all but the block GEMMs; MFU's peak


@pytest.mark.parametrize("recompute", [0, 2])
def test_nvfp4_runs_the_block_gemms_at_the_fp4_peak_and_streams_the_casts(recompute):
    """By hand: the block's non-attention FLOPs (3 passes, 4 with full recompute; 24 s h^2 a sample forward) move
    from the bf16 to the fp4 peak, on the curve with the half point 4x as large (the same fixed time a GEMM, at 4x the
    rate); the casts stream, for each of X, W and G quantised
    twice, 2 B (amax read) + 2 B (read) + 0.5 B (e2m1) + 1/16 B (e4m3 scale) = 4.5625 B a cast, 9.125 B an element,
    of X and G (16 h a token: 4 / (3 h) of the 12 h^2 parameters) and of the weights."""
    passes = 3 + (recompute == 2)
    gemm = B * passes * 24.0 * S * H * H
    eff = gemm_efficiency(np.array([2.0 * B * S * H * 4 * H]), B200)[0]
    eff_fp4 = gemm_efficiency(np.array([2.0 * B * S * H * 4 * H]), B200, 4.0)[0]
    casts = 9.125 * (B * S * 16 * H + 12.0 * H * H)
    nvfp4 = block_time_s(model(), one(recompute), B200, "nvfp4")[0]
    bf16 = block_time_s(model(), one(recompute), B200, "bf16")[0]
    expected = gemm / (9000e12 * eff_fp4) - gemm / (2250e12 * eff) + casts / activation_ops_Bps(B200)
    assert nvfp4 - bf16 == pytest.approx(expected)


def test_nvfp4_keeps_the_head_and_states_of_bf16_and_adds_its_cast_temporaries():
    """The head's GEMM stays bf16; memory is bf16's plus 30 B per (b, s, ffn) element of the quantisations' live
    temporaries in a block's backward (measured by the dry run: planner.cost.memory.
    NVFP4_CAST_TEMPORARY_BYTES_PER_ELEMENT), counted in the buffers; with a 16-token vocabulary (no large logits at
    the loss) the backward binds the peak in both, which rises by them less bf16's margin of its loss peak over its
    backward's."""
    from dataclasses import replace

    cand = one()
    assert edge_time_s(2.0 * S * H * V, model(), cand, B200, "nvfp4", loss=True)[0] == pytest.approx(
        edge_time_s(2.0 * S * H * V, model(), cand, B200, "bf16", loss=True)[0])
    m, small_vocab = np.array([4.0]), replace(model(), vocab=16, head_fwd_flops=2.0 * S * H * 16)
    nvfp4 = memory_per_gpu(small_vocab, cand, B200, "nvfp4", m)
    bf16 = memory_per_gpu(small_vocab, cand, B200, "bf16", m)
    temporaries = 30.0 * B * S * 4 * H
    assert nvfp4.comm_buffers[0] - bf16.comm_buffers[0] == pytest.approx(temporaries)
    assert temporaries * 0.99 < nvfp4.total[0] - bf16.total[0] <= temporaries
    assert nvfp4.parameters[0] == bf16.parameters[0] and nvfp4.optimizer[0] == bf16.optimizer[0]


def test_mfu_is_against_the_bf16_peak():
    """The same model FLOPs and the same denominator (the bf16 peak): MFU scales with the inverse of the step time."""
    nvfp4 = estimate_step(model(), one(), B200, "nvfp4", global_batch=8 * B)
    bf16 = estimate_step(model(), one(), B200, "bf16", global_batch=8 * B)
    assert nvfp4.mfu[0] / bf16.mfu[0] == pytest.approx(bf16.step_time_s[0] / nvfp4.step_time_s[0])
    assert nvfp4.tensor_parallel_s[0] == bf16.tensor_parallel_s[0] == 0.0  # tp 1: no amax all-reduces


@pytest.mark.parametrize("cluster", ["dgx-h100", "dgx-a100-80g", "cpu-local"])
def test_compile_refuses_nvfp4_where_the_gpu_has_no_fp4_tensor_cores(cluster):
    with pytest.raises(SpecError, match="no fp4 tensor cores"):
        prepare("examples/tiny.py", 2 if cluster == "cpu-local" else 8, cluster, None, None, "nvfp4", Pins())


def test_nvfp4_compiles_at_tp_1_refuses_a_tp_pin_and_estimates_any_layout():
    """The runtime has no nvfp4 tensor parallel: the search keeps tp 1 (bf16's alternatives for the same request
    split 2, 4 and 8 ways), a --tp 2 pin fails at compile, and `zplan estimate` still prices tp 2 (a published
    layout)."""
    pins = Pins(pp=1, zero=1, micro_batch=8, recompute="none")
    plan, search = compile_with_alternatives(prepare(LLAMA, 8, "dgx-b200", 64, None, "nvfp4", pins))
    _, bf16 = compile_with_alternatives(prepare(LLAMA, 8, "dgx-b200", 64, None, "bf16", pins))
    assert (plan.parallel.tp, plan.pins.tp, plan.train.precision) == (1, None, "nvfp4")
    assert {alt.parallel.tp for alt in search.alternatives} == {1}
    assert {alt.parallel.tp for alt in bf16.alternatives} == {1, 2, 4, 8}
    with pytest.raises(SpecError, match="--tp 2 asks for it: pin --tp 1"):
        compile_plan(prepare(LLAMA, 8, "dgx-b200", 64, None, "nvfp4", Pins(tp=2)))
    estimate = estimate_config(prepare(LLAMA, 8, "dgx-b200", 64, None, "nvfp4", Pins(tp=2, pp=1)))
    assert (estimate["config"]["tp"], estimate["runtime_runs_it"]) == (2, False)
    assert estimate_config(prepare(LLAMA, 8, "dgx-b200", 64, None, "nvfp4", Pins(tp=1, pp=1)))["runtime_runs_it"]


def test_an_nvfp4_plan_prices_faster_than_fp8_and_bf16_and_says_what_it_assumes():
    """Blocks large enough that each precision's device time per block outlasts the host's dispatch of it."""
    pins = Pins(tp=1, pp=1, zero=3, micro_batch=4, recompute="none")
    large = "llama:layers=8,hidden=4096,heads=32,kv_heads=32,ffn=16384,seq=8192,vocab=32000"
    steps = {precision: compile_with_alternatives(prepare(large, 8, "dgx-b200", 64, None, precision, pins))
             for precision in ("bf16", "fp8", "nvfp4")}
    times = [steps[p][0].prediction.step_time_s for p in ("nvfp4", "fp8", "bf16")]
    assert times == sorted(times) and times[0] < times[1]
    rows = {a.name: a.value for a in steps["nvfp4"][1].assumptions}
    assert "9000 TFLOP/s" in rows["nvfp4 training"] and "9.125 B" in rows["nvfp4 training"]
    assert "peak bf16 FLOP/s" in rows


def test_train_py_refuses_an_nvfp4_plan_with_tensor_parallel():
    from tests.plan_samples import sample_plan
    from zplan.runtime.plan.check import runtime_gaps

    plan = sample_plan()
    nvfp4 = plan.model_copy(update={"train": plan.train.model_copy(update={"precision": "nvfp4"})})
    split = nvfp4.model_copy(update={"parallel": nvfp4.parallel.model_copy(update={"tp": 2})})
    assert not any("nvfp4" in gap for gap in runtime_gaps(nvfp4.model_copy(
        update={"parallel": nvfp4.parallel.model_copy(update={"tp": 1})})))
    assert any(gap.startswith("nvfp4 with tp=2") for gap in runtime_gaps(split))


def test_compile_and_train_py_refuse_nvfp4_for_blocks_without_an_nvfp4_linear(tmp_path):
    """GPT-2's projections are transformers' Conv1D: nvfp4 would convert nothing, so compile refuses it naming the
    block (schemas.capability 'no_nvfp4_linears'), and so does the emitted program's check of plan.json; the zoo's
    Llama (nn.Linear, widths multiples of 16) compiles."""
    pytest.importorskip("transformers")
    from tests.hf_zoo import write_model_files
    from zplan.schemas.capability import ModelTrait, capability_problems

    files = write_model_files(tmp_path)
    with pytest.raises(SpecError, match=r"--precision nvfp4: .*transformer\.h\.0 .*use --precision bf16"):
        prepare(str(files["gpt2"]), 8, "dgx-b200", 8, None, "nvfp4", Pins())
    assert prepare(str(files["llama"]), 8, "dgx-b200", 8, None, "nvfp4", Pins()).train.precision == "nvfp4"
    trait = ModelTrait(kind="no_nvfp4_linears", module="blocks.0", detail="no nn.Linear")
    assert capability_problems([trait], 1, 1, False, fp8=True) == []
    [problem] = capability_problems([trait], 1, 1, False, nvfp4=True)
    assert problem.startswith("train.precision: the runtime cannot run nvfp4 on this model: blocks.0 (no nn.Linear)")
