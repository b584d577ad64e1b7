"""fp8 weights in the serving planner: the cost model's bytes and FLOPs by hand, compile's refusal where the GPU has
no fp8 peak, the search's rule (fp8 only when pinned), throughput.numerics_for, and a pinned fp8 plan's program
building an fp8 engine (on the CPU, as generate.py / serve.py do)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from zplan.errors import SpecError
from zplan.inference_api import compile_inference_plan, compile_inference_with_alternatives, prepare, search_space
from zplan.planner.clusters import DGX_H100, load_cluster
from zplan.planner.inference.cost import (
    WEIGHT_PRECISIONS,
    WEIGHT_TIERS,
    InferenceCandidates,
    InferenceModel,
    Workload,
    estimate,
    fp8_scales_per_weight,
    weight_bytes_per_param,
)
from zplan.planner.inference.throughput import numerics_for
from zplan.schemas.cluster import EfficiencySpec
from zplan.schemas.export import JSON_DIR

ROOT = Path(__file__).resolve().parents[2]
LLAMA_SMALL = "llama:layers=4,hidden=512,heads=8,kv_heads=2,ffn=1024,seq=256,vocab=1000"
# The round model of test_inference_cost.py: L = 10, h = 1000, 10 heads of d = 100, f = 4000, V = 1000, W = 12e6.
MODEL = InferenceModel(layers=10, hidden=1000, heads=10, kv_heads=10, ffn=4000, vocab=1000,
                       block_linear_params=12e6, replicated_params=2e6, decode_read_params=1e6, position_rows=None)
# 1 PFLOP/s bf16 and 2 PFLOP/s fp8 at half efficiency for any GEMM, 1 TB/s HBM at half.
CLUSTER = DGX_H100.model_copy(update={
    "gpu": DGX_H100.gpu.model_copy(update={"hbm_bytes": 100 * 10**9, "hbm_bandwidth_Bps": 1e12,
                                           "peak_bf16_flops": 1e15, "peak_fp8_flops": 2e15}),
    "framework_reserve_bytes": 10**9,
    "efficiency": EfficiencySpec(gemm_max=0.5, gemm_half_flops=1e-9, memory_bound=0.5, intra_node_link=1.0,
                                 inter_node_link=1.0, host_link=0.5),
})


def one(precision: str, tp: int = 1, batch: int = 1) -> InferenceCandidates:
    return InferenceCandidates(tp=np.array([tp]), precision=np.array([WEIGHT_PRECISIONS.index(precision)]),
                               tier=np.array([WEIGHT_TIERS.index("gpu")]), batch=np.array([batch]))


def run(precision: str, tp: int = 1, batch: int = 1, prompt: int = 100, gen: int = 20):
    return estimate(MODEL, one(precision, tp, batch), CLUSTER,
                    Workload(prompt_len=prompt, gen_len=gen, compute_dtype="bf16", gpus=tp))


def test_fp8_weights_cost_one_byte_plus_a_scale_per_output_channel():
    """q/k/v + up: (W - a d h - f h) / h = (12e6 - 1e6 - 4e6) / 1000 = 7000 output rows (split over tp); o and down
    h = 1000 rows each on every GPU. tp = 1: 12e6 bytes + 9000 * 4; tp = 2: 6e6 + (3500 + 2000) * 4."""
    assert fp8_scales_per_weight(MODEL, np.array([1, 2])).tolist() == pytest.approx([9000 / 12e6, 5500 / 6e6])
    fp8 = np.array([WEIGHT_PRECISIONS.index("fp8")])
    assert weight_bytes_per_param(fp8)[0] == 1.0  # before the scales
    e1, e2 = run("fp8"), run("fp8", tp=2)
    # the head (V h = 1e6) and the other replicated parameters stay bf16: 2e6 * 2 bytes
    assert e1.weights[0] == pytest.approx(10 * (12e6 + 9000 * 4) + 2e6 * 2)
    assert e2.weights[0] == pytest.approx(10 * (6e6 + 5500 * 4) + 2e6 * 2)
    int8 = run("int8")  # int8: the head quantized too, 8 inputs a group (1000 = 8 * 125)
    assert int8.weights[0] == pytest.approx(10 * 12e6 * (1 + 4 / 8) + 1e6 * 2 + 1e6 * (1 + 4 / 8))


def test_fp8_block_gemms_run_at_the_fp8_peak_and_the_rest_at_bf16s():
    """Prefill of 8 x 1000 tokens: block GEMMs 2 W L B P = 1.92e12 FLOPs at 2e15 * 0.5; attention 2 L B P^2 h =
    1.6e11 and logits 2 h V B = 1.6e7 at 1e15 * 0.5 -- 1.92e-3 + 3.20032e-4 s; bf16: 3.84e-3 + 3.20032e-4 s."""
    fp8, bf16 = run("fp8", batch=8, prompt=1000), run("bf16", batch=8, prompt=1000)
    assert fp8.prefill_compute_s[0] == pytest.approx(1.92e12 / 1e15 + 1.60016e11 / 5e14)
    assert bf16.prefill_compute_s[0] == pytest.approx(1.92e12 / 5e14 + 1.60016e11 / 5e14)
    # a batch-1 decode step is memory bound: the weight bytes read, 1 byte a weight instead of 2
    small = run("fp8")
    read = 10 * (12e6 + 9000 * 4) + 1e6 * 2  # blocks + head (decode_read_params - V h = 0)
    assert small.decode_weights_s[0] == pytest.approx(read / 5e11)


@pytest.mark.parametrize("cluster", ["dgx-a100-80g", "cpu-local"])
def test_compile_refuses_fp8_without_fp8_tensor_cores(cluster):
    with pytest.raises(SpecError, match="--precision fp8 needs fp8 tensor cores.*--precision int8"):
        prepare(LLAMA_SMALL, 1, cluster, precision="fp8")


def test_fp8_is_chosen_only_when_pinned():
    unpinned = prepare(LLAMA_SMALL, 8, "dgx-h100")
    assert "fp8" not in search_space(unpinned).precisions
    pinned, search = compile_inference_with_alternatives(prepare(LLAMA_SMALL, 8, "dgx-h100", precision="fp8",
                                                                 target="throughput"))
    assert (pinned.parallel.weight_precision, pinned.parallel.compute_dtype) == ("fp8", "bf16")
    assert {a.weight_precision for a in search.alternatives} == {"fp8"}
    assert "as pinned (--precision fp8)" in pinned.reason
    assert any(a.name == "fp8" for a in search.assumptions)
    assert not any(a.name == "fp8" for a in compile_inference_with_alternatives(unpinned)[1].assumptions)
    schema = json.loads((JSON_DIR / "inference_plan.schema.json").read_text())
    jsonschema.validate(json.loads(pinned.model_dump_json()), schema)


def test_numerics_for_fp8_is_zplans_w8a8():
    h100 = load_cluster("dgx-h100")
    num = numerics_for("fp8", "bf16", MODEL, 1, h100)
    assert num.block_weight_bytes == pytest.approx(1 + 4 * 9000 / 12e6)
    assert (num.head_weight_bytes, num.kv_bytes, num.activation_bytes) == (2.0, 2.0, 2.0)
    assert (num.gemm_peak_flops, num.other_peak_flops) == (h100.gpu.peak_fp8_flops, h100.gpu.peak_bf16_flops)
    bf16 = numerics_for("bf16", "bf16", MODEL, 1, h100)
    assert bf16.gemm_peak_flops == bf16.other_peak_flops == h100.gpu.peak_bf16_flops


def test_a_pinned_fp8_plan_builds_an_fp8_engine(tmp_path):
    """examples/tiny.py pinned to fp8 on one H100; engine_from_plan on this CPU keeps the fp8 weights (fp32
    activations, torch's CPU _scaled_mm) as generate.py and serve.py would."""
    from zplan.runtime.inference.build import engine_from_plan
    from zplan.runtime.inference.sampling import SamplingParams
    from zplan.runtime.launch.distributed import close_distributed

    model_file = ROOT / "examples" / "tiny.py"
    plan = compile_inference_plan(prepare(str(model_file), 1, "dgx-h100", precision="fp8", batch=2, prompt_len=16,
                                          gen_len=4))
    assert plan.parallel.weight_precision == "fp8"
    try:
        engine, tokenizer, _ = engine_from_plan(plan, model_file)
        tokens = engine.generate([tokenizer.encode("fp8")], 4, SamplingParams())
    finally:
        close_distributed(clean=True)
    assert engine.store.layer(0)["qkv.fp8_weight"].dtype == torch.float8_e4m3fn
    assert engine.compute_dtype == torch.float32 and len(tokens[0]) >= 1
