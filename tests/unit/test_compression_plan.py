"""Compression in the planner (--compress): parsing and contradictions, the candidates the search keeps, the cost
model's compressed bytes and quantizing passes against hand computations, the suggestion where data-parallel
communication dominates, the report, ds_config.json, and old plan files still loading."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from tests.plan_samples import sample_plan
from zplan.api import compile_plan, compile_with_alternatives, prepare
from zplan.cli import app
from zplan.codegen.ds_config import deepspeed_config, deepspeed_config_notes
from zplan.codegen.render import render_reports
from zplan.errors import SpecError
from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.compression import (
    ONE_BIT_WARMUP_STEPS,
    SUGGEST_DATA_PARALLEL_SHARE,
    check_compression,
    parse_compress,
)
from zplan.planner.cost.comm import all_reduce_s, all_to_all_s
from zplan.planner.cost.compression import compressed_gradient_reduce_s, wire_bytes_per_step
from zplan.planner.cost.inputs import Candidates, ModelNumbers
from zplan.planner.cost.step import estimate_step
from zplan.planner.enumerate import enumerate_candidates
from zplan.schemas.plan import Plan
from zplan.schemas.spec import CompressionConfig, Pins

A100 = BUILTIN_CLUSTERS["dgx-a100-80g"]
GPT_350M = "gpt:layers=24,hidden=1024,heads=16,seq=1024,vocab=51200"
GPT_SMALL = "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000"
DATA_PARALLEL = dict(tp=1, pp=1, zero=0, micro_batch=1, recompute="none")


def _cand(**kw) -> Candidates:
    base = dict(tp=1, pp=1, dp=16, micro_batch=1, zero=0, recompute=0, sp=0, interleave=1, offload=0)
    return Candidates.single(**{**base, **kw})


def _model(params: float = 1e8, blocks: int = 4, hidden: int = 1024, seq: int = 1024) -> ModelNumbers:
    """A model whose whole parameter count is `params` (embedding and head inside it)."""
    return ModelNumbers(num_blocks=blocks, hidden=hidden, heads=16, ffn_hidden=4 * hidden, vocab=1000, seq_len=seq,
                        params=params, embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0, head_fwd_flops=0.0,
                        block_params=params / blocks, block_fwd_flops=2.0 * seq * params / blocks,
                        block_act_bytes=34.0 * seq * hidden, embed_act_bytes=0.0, head_act_bytes=0.0)


def _profile_file(tmp_path, spec) -> str:
    """`spec` with its host time unpriced (these plans' small blocks would wait for the host's dispatch, which the
    data-parallel collectives hide behind: the decision is checked on the device's terms), as a cluster file."""
    path = tmp_path / f"{spec.name}.yaml"
    path.write_text(yaml.safe_dump(spec.without_host().model_dump()))
    return str(path)


def _slow_cluster(tmp_path) -> str:
    """DGX A100 nodes joined by 10 Gb/s per GPU instead of 200 Gb/s: data parallelism across nodes dominates."""
    return _profile_file(tmp_path, A100.model_copy(update={"name": "a100-10gbe", "inter_node_bandwidth_Bps": 1.25e9}))


def _plan(model, gpus, cluster, batch, precision="bf16", **pins):
    return compile_plan(prepare(model, gpus, cluster, batch, None, precision, Pins(**pins)))


def _plan_and_search(model, gpus, cluster, batch, precision="bf16", **pins):
    return compile_with_alternatives(prepare(model, gpus, cluster, batch, None, precision, Pins(**pins)))


# ---- parsing and contradictions -----------------------------------------------------------------------------


def test_parse_every_key_and_none():
    assert parse_compress("grad=int8,weights=int8,act=int8") == CompressionConfig(
        grad="int8", weights="int8", activations="int8")
    assert parse_compress(" grad = 1bit ") == CompressionConfig(grad="1bit")
    assert parse_compress("grad=none") == CompressionConfig()
    assert parse_compress("act=int8").as_option() == "act=int8"
    assert CompressionConfig().as_option() == "none" and not CompressionConfig().enabled


@pytest.mark.parametrize("text,needle", [
    ("act=int4", "act takes none or int8"),
    ("weights=1bit", "weights takes none or int8"),
    ("grad=fp8", "grad takes none or int8 or 1bit"),
    ("gradients=int8", "no key 'gradients'"),
    ("grad", "key=value"),
    ("grad=int8,,act=int8", "key=value"),
    ("grad=int8,grad=1bit", "twice"),
])
def test_bad_values_name_what_is_allowed(text, needle):
    with pytest.raises(SpecError, match=needle):
        parse_compress(text)


@pytest.mark.parametrize("compress,pins,needle", [
    ("grad=1bit", Pins(zero=2), "needs ZeRO 0 or 1"),
    ("grad=1bit", Pins(tp=2), "tp = 1"),
    ("grad=1bit", Pins(pp=2), "pp = 1"),
    ("grad=1bit", Pins(interleave=2), "pp = 1"),
    ("grad=1bit", Pins(offload="cpu"), "needs no offload"),
    ("grad=int8", Pins(zero=2), "needs ZeRO 0 or 1"),
    ("grad=int8", Pins(tp=4), "--tp 4 is pinned"),
    ("grad=int8", Pins(sequence_parallel=True), "--sequence-parallel"),
    ("weights=int8", Pins(zero=1), "needs ZeRO 3"),
    ("act=int8", Pins(pp=1), "pp > 1"),
    ("grad=1bit,weights=int8", Pins(), "contradict"),
    ("grad=int8,weights=int8", Pins(), "contradict"),
    ("grad=1bit,act=int8", Pins(), "contradict"),
])
def test_contradictions_fail_before_the_search(compress, pins, needle):
    with pytest.raises(SpecError, match=needle):
        check_compression(parse_compress(compress), pins, 16)


def test_act_int8_on_one_gpu_and_delayed_update_with_weights_fail():
    with pytest.raises(SpecError, match="one GPU has no pipeline"):
        check_compression(parse_compress("act=int8"), Pins(), 1)
    with pytest.raises(SpecError, match="--delayed-update on"):
        check_compression(parse_compress("weights=int8"), Pins(), 8, delayed_update="on")
    check_compression(parse_compress("grad=int8,act=int8"), Pins(zero=1, tp=1, pp=2), 8)  # consistent: no error


def test_int8_activations_need_a_hidden_size_that_divides_by_4():
    with pytest.raises(SpecError, match="divide by 4"):
        prepare("gpt:layers=4,hidden=250,heads=5,seq=128,vocab=1000", 8, "dgx-a100-80g", 16, None, "bf16",
                Pins(compress=parse_compress("act=int8")))


@pytest.mark.parametrize("compress,rule", [
    ("grad=int8", lambda c: (c.zero <= 1) & (c.tp == 1)),
    ("grad=1bit", lambda c: (c.zero <= 1) & (c.tp == 1) & (c.pp == 1) & (c.offload == 0)),
    ("weights=int8", lambda c: c.zero == 3),
    ("act=int8", lambda c: c.pp > 1),
])
def test_the_search_keeps_exactly_the_configurations_that_support_it(compress, rule):
    summary = prepare(GPT_SMALL, 16, "dgx-a100-80g", 16, None, "bf16", Pins()).summary
    free = enumerate_candidates(summary, A100, 16, 16, Pins())
    config = parse_compress(compress)
    kept = enumerate_candidates(summary, A100, 16, 16, Pins(compress=config))
    assert 0 < len(kept) == int(rule(free).sum()) < len(free)
    assert rule(kept).all()
    assert _config_indices(kept) == {_config_indices_of(config)}


def _config_indices(cand: Candidates) -> set[tuple[int, int, int]]:
    return set(zip(cand.grad_compress.tolist(), cand.weight_compress.tolist(), cand.act_compress.tolist(), strict=True))


def _config_indices_of(config: CompressionConfig) -> tuple[int, int, int]:
    return ({"none": 0, "int8": 1, "1bit": 2}[config.grad], int(config.weights == "int8"),
            int(config.activations == "int8"))


# ---- the cost model against hand computations -------------------------------------------------------------


def _intra(cluster=A100):
    return cluster.intra_node_bandwidth_Bps * cluster.efficiency.intra_node_link


def _inter(cluster=A100):
    return cluster.inter_node_bandwidth_Bps * cluster.efficiency.inter_node_link


def _hand_all_to_all(S, n=16, g=8, k=2):
    """Direct sends: (g-1)/n of S to the node's ranks over NVLink, (n-g)/n to the other node over the NIC."""
    return ((g - 1) / n * S / _intra() + (g - 1) * A100.intra_node_latency_s
            + (n - g) / n * S / _inter() + (k - 1) * A100.inter_node_latency_s)


def _hand_all_gather(S, n=16, g=8, k=2):
    """Hierarchical: (g-1)/g of S inside the node, each local rank carrying 1/g of it across nodes."""
    return ((g - 1) / g * S / _intra() + (g - 1) * A100.intra_node_latency_s
            + (k - 1) / k * S / g / _inter() + (k - 1) * A100.inter_node_latency_s)


def _memory_Bps():
    return A100.gpu.hbm_bandwidth_Bps * A100.efficiency.memory_bound


def test_all_to_all_over_two_nodes_by_hand():
    S = 1e9
    got = all_to_all_s(np.array([S]), np.array([16]), np.array([1]), A100)[0]
    assert got == pytest.approx(_hand_all_to_all(S))
    # inside one node it moves what one ring pass moves: (n-1)/n of S
    inside = all_to_all_s(np.array([S]), np.array([8]), np.array([1]), A100)[0]
    assert inside == pytest.approx(7 / 8 * S / _intra() + 7 * A100.intra_node_latency_s)


def test_int8_gradients_by_hand():
    """1e8 parameters, dp 16 over two nodes: 4e8 bytes of fp32 gradients in ceil(4e8 / 25 MiB) = 16 DDP
    buckets; each bucket's 1.015625e8 / 16 int8 bytes (with scales) go through an all-to-all and an all-gather;
    31 bytes per element of quantizing passes at 2039 GB/s x 0.8."""
    P, calls = 1e8, 16
    C = P * (1 + 4 / 256)
    hand = calls * (_hand_all_to_all(C / calls) + _hand_all_gather(C / calls)) + P * 31 / _memory_Bps()
    cand = _cand(grad_compress=1)
    got = compressed_gradient_reduce_s(np.array([P]), cand, A100, np.array([16.0]))[0]
    assert got == pytest.approx(hand)
    # in the step: not hidden behind the backward, plus the logged loss's all-reduce over the 16 ranks
    est = estimate_step(_model(P), cand, A100, "bf16", 16)
    loss = all_reduce_s(np.array([4.0]), np.array([16]), np.array([1]), A100)[0]
    assert est.data_parallel_s[0] == pytest.approx(hand + loss)


def test_one_bit_gradients_by_hand():
    """1-bit Adam after its warm-up: one call per step of 1e8 x (1/8 + 4/256) bytes, 114.375 bytes a element of
    passes; ZeRO 0, so no weight sync."""
    P = 1e8
    C = P * (1 / 8 + 4 / 256)
    hand = _hand_all_to_all(C) + _hand_all_gather(C) + P * 114.375 / _memory_Bps()
    est = estimate_step(_model(P), _cand(grad_compress=2), A100, "bf16", 16)
    loss = all_reduce_s(np.array([4.0]), np.array([16]), np.array([1]), A100)[0]
    assert est.data_parallel_s[0] == pytest.approx(hand + loss)


def test_compression_leaves_every_other_term_alone():
    model, plain = _model(), _cand(pp=2, dp=8, zero=1)
    squeezed = estimate_step(model, _cand(pp=2, dp=8, zero=1, grad_compress=1, act_compress=1), A100, "bf16", 16)
    base = estimate_step(model, plain, A100, "bf16", 16)
    for part in ("compute_s", "tensor_parallel_s", "pipeline_bubble_s", "offload_s", "optimizer_s"):
        assert getattr(squeezed, part)[0] == getattr(base, part)[0]
    assert squeezed.data_parallel_s[0] != base.data_parallel_s[0]
    assert squeezed.pipeline_p2p_s[0] != base.pipeline_p2p_s[0]


def test_int8_weights_by_hand():
    """ZeRO 3, dp 8 in one node, where communication does not overlap compute: 4 blocks + 1 root = 5 units, each
    gathered before its forward and its backward in each of m = 2 micro-batches; int8 gathers move 1 + 4/256
    bytes an element instead of 2, and each gather dequantizes the unit (1 + 2 bytes) and quantizes this rank's
    1/8 shard (5 bytes)."""
    cluster = A100.model_copy(update={"overlaps_comm_with_compute": False})
    model, P, units, m = _model(), 1e8, 5, 2

    def gather(S):
        return 7 / 8 * S / _intra(cluster) + 7 * cluster.intra_node_latency_s

    hand = (2 * m * units * (gather(P / units * (1 + 4 / 256)) - gather(P / units * 2))
            + 2 * m * P * (3 + 5 / 8) / _memory_Bps())
    plain = estimate_step(model, _cand(dp=8, zero=3), cluster, "bf16", 16)
    int8 = estimate_step(model, _cand(dp=8, zero=3, weight_compress=1), cluster, "bf16", 16)
    assert int8.data_parallel_s[0] - plain.data_parallel_s[0] == pytest.approx(hand)


def test_int8_activations_by_hand():
    """pp 2, one rank per stage in one node, m = 16 micro-batches of 1 x 1024 x 1024 elements: each crossing
    sends (1 + 4/1024) bytes an element over NVLink and is encoded and decoded (20 bytes an element forward,
    26 backward, bf16)."""
    model = _model()
    elements = 1024 * 1024
    crossing = elements * (1 + 4 / 1024) / _intra() + A100.intra_node_latency_s
    hand = 16 * (2 * crossing + elements * (20 + 26) / _memory_Bps())
    est = estimate_step(model, _cand(pp=2, dp=1, act_compress=1), A100, "bf16", 16)
    assert est.pipeline_p2p_s[0] == pytest.approx(hand)


def test_wire_bytes_by_hand():
    P, m = np.array([1e8]), np.array([4.0])
    int8 = wire_bytes_per_step(_cand(grad_compress=1), P, m, 1024, 1024, 2)
    assert int8.gradients[0] == pytest.approx(2 * 15 / 16 * 1e8 * (1 + 4 / 256))
    assert wire_bytes_per_step(_cand(), P, m, 1024, 1024, 2).gradients[0] == pytest.approx(2 * 15 / 16 * 2e8)
    weights = wire_bytes_per_step(_cand(zero=3, weight_compress=1), P, m, 1024, 1024, 2)
    assert weights.gradients[0] == 0 and weights.weights[0] == pytest.approx(2 * 4 * 15 / 16 * 1e8 * (1 + 4 / 256))
    acts = wire_bytes_per_step(_cand(pp=2, dp=1, act_compress=1, interleave=2), P, m, 1024, 1024, 2)
    assert acts.activations[0] == pytest.approx(2 * 2 * 4 * 1024 * 1024 * (1 + 4 / 1024))


def test_memory_of_the_compressed_collectives_by_hand():
    """int8: four copies of a 25 MiB DDP bucket; 1-bit: the worker's and server's error feedback (4 x (1 + 1/16)
    bytes a parameter), the step's 24 bytes a parameter beyond the activations it outlives, and, since 1-bit Adam
    steps fp32 parameters under autocast where plain bf16 ZeRO-0 holds bf16 parameters, autocast's bf16 copies of the
    weights (2 bytes a parameter; the fp32 weights and gradients cost 4 + 4 where the bf16 ones and the fp32 master
    cost 2 + 2 + 4: the states are equal)."""
    model, P = _model(), 1e8
    plain = estimate_step(model, _cand(), A100, "bf16", 16).memory
    int8 = estimate_step(model, _cand(grad_compress=1), A100, "bf16", 16).memory
    one_bit = estimate_step(model, _cand(grad_compress=2), A100, "bf16", 16).memory
    assert int8.comm_buffers[0] - plain.comm_buffers[0] == pytest.approx(4 * 25 * 1024**2)
    # and the (V, h) table's gradient made in backward, fp32 where plain bf16 makes it in bf16: 2 bytes a value more
    extra = 2 * P + 4 * (1 + 1 / 16) * P + max(0.0, 24 * P - float(plain.activations[0])) + 2 * 1000 * 1024
    assert one_bit.comm_buffers[0] - plain.comm_buffers[0] == pytest.approx(extra)
    assert one_bit.total[0] - plain.total[0] == pytest.approx(extra)


# ---- the decision and the suggestion ------------------------------------------------------------------------


def test_a_data_parallel_bound_plan_is_told_what_one_bit_adam_saves_and_compiling_with_it_agrees(tmp_path):
    cluster = _slow_cluster(tmp_path)
    plain = _plan(GPT_350M, 32, cluster, 32, **DATA_PARALLEL)
    decision = plain.compression
    assert decision.applied is None
    assert decision.data_parallel_share >= SUGGEST_DATA_PARALLEL_SHARE
    assert decision.data_parallel_share == pytest.approx(
        plain.prediction.time.data_parallel / plain.prediction.step_time_s)
    options = {o.compress: o for o in decision.suggestions}
    assert set(options) == {"grad=int8", "grad=1bit"}  # ZeRO 0 qualifies for both, ZeRO 3's weights not
    one_bit = options["grad=1bit"]
    assert one_bit.saved_s > 0 and one_bit.fits
    # the prediction the suggestion makes is what compiling with it predicts
    compressed, search = _plan_and_search(GPT_350M, 32, cluster, 32, compress=parse_compress("grad=1bit"),
                                          **DATA_PARALLEL)
    assert compressed.prediction.step_time_s == pytest.approx(one_bit.step_time_s, rel=1e-9)
    assert compressed.prediction.step_time_s == pytest.approx(plain.prediction.step_time_s - one_bit.saved_s)
    assert compressed.compression.applied.saved_s == pytest.approx(one_bit.saved_s)
    # bytes: 2 (W-1)/W of the gradients, 2 bytes an element uncompressed, 1/8 + 4/256 compressed
    params = plain.prediction.memory.parameters / 2  # bf16 weights under ZeRO 0 (the fp32 masters: the optimizer's)
    assert one_bit.uncompressed_wire_bytes == pytest.approx(2 * 31 / 32 * 2 * params)
    assert one_bit.wire_bytes == pytest.approx(2 * 31 / 32 * (1 / 8 + 4 / 256) * params)
    assert decision.reason.startswith("off: ") and "--compress grad=1bit would save" in decision.reason
    assert compressed.compression.reason.startswith("on (--compress grad=1bit)") and " saves " in (
        compressed.compression.reason)
    assert compressed.parallel.compression.grad == "1bit"
    assert {alt.parallel.compression.grad for alt in search.alternatives} == {"1bit"}


def test_on_the_builtin_v100_cluster_the_runtime_s_compression_would_not_pay(tmp_path):
    """dgx2-v100's 6.25 GB/s per GPU across nodes: short sequences make the gradient all-reduce outlast the
    backward; the compressed all-to-all sends 16 times more across nodes per byte than the hierarchical ring, and
    1-bit Adam's passes over memory cost more than they save, so the report says both would cost time."""
    plan = _plan("gpt:layers=24,hidden=1024,heads=16,seq=256,vocab=51200", 32,
                 _profile_file(tmp_path, BUILTIN_CLUSTERS["dgx2-v100"]), 32, "fp16", **DATA_PARALLEL)
    decision = plan.compression
    assert decision.data_parallel_share >= SUGGEST_DATA_PARALLEL_SHARE
    assert {o.compress for o in decision.suggestions} == {"grad=int8", "grad=1bit"}
    assert all(o.saved_s < 0 for o in decision.suggestions)
    assert "would cost" in decision.reason and "direct all-to-all" in decision.reason


def test_no_suggestion_for_a_compute_bound_plan():
    plan = _plan("gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200", 8, "dgx-a100-80g", 256)
    decision = plan.compression
    assert decision.data_parallel_share < SUGGEST_DATA_PARALLEL_SHARE
    assert decision.suggestions == [] and decision.applied is None
    assert "under the 20%" in decision.reason


def test_a_plan_no_setting_applies_to_says_so(tmp_path):
    plan = _plan(GPT_350M, 32, _slow_cluster(tmp_path), 32, tp=1, pp=1, zero=2)
    assert plan.compression.data_parallel_share >= SUGGEST_DATA_PARALLEL_SHARE
    assert plan.compression.suggestions == []
    assert "no --compress setting applies to ZeRO-2" in plan.compression.reason


def test_the_report_shows_the_suggestion_and_the_saving(tmp_path):
    cluster = _slow_cluster(tmp_path)
    plain = _plan(GPT_350M, 32, cluster, 32, **DATA_PARALLEL)
    reports = render_reports(plain)
    assert f"| Compression | {plain.compression.reason} |" in reports["report.md"]
    assert "--compress grad=1bit would save" in reports["report.md"]
    assert "<td>Compression</td>" in reports["report.html"] and "--compress grad=1bit would save" in (
        reports["report.html"])
    compressed, search = _plan_and_search(GPT_350M, 32, cluster, 32, compress=parse_compress("grad=1bit"),
                                          **DATA_PARALLEL)
    markdown = render_reports(compressed)["report.md"]
    assert "| Compression | on (--compress grad=1bit): against the same configuration without compression it " \
           "saves" in markdown
    assert "compress=grad=1bit" in markdown  # the pin, as given, and the chosen configuration's label


def test_ds_config_carries_deepspeed_s_equivalents():
    one_bit = sample_plan("tiny-dp", parallel={"compression": {"grad": "1bit"}})
    optimizer = deepspeed_config(one_bit)["optimizer"]
    assert optimizer["type"] == "OneBitAdam"
    assert optimizer["params"]["freeze_step"] == ONE_BIT_WARMUP_STEPS
    assert optimizer["params"]["comm_backend_name"] == "nccl"
    assert "OneBitAdam" in " ".join(deepspeed_config_notes(one_bit))

    zero3 = sample_plan("tiny-dp", parallel={"zero_stage": 3, "compression": {"weights": "int8", "grad": "int8"}})
    block = deepspeed_config(zero3)["zero_optimization"]
    assert block["zero_quantized_weights"] is True and block["zero_quantized_gradients"] is True

    zero1 = sample_plan("tiny-dp", parallel={"zero_stage": 1, "compression": {"grad": "int8"}})
    block = deepspeed_config(zero1)["zero_optimization"]
    assert "zero_quantized_gradients" not in block and "zero_quantized_weights" not in block
    assert "no int8 gradient all-reduce" in " ".join(deepspeed_config_notes(zero1))

    acts = sample_plan("gpt3-175b", parallel={"compression": {"activations": "int8"}})
    assert "no DeepSpeed config block" in " ".join(deepspeed_config_notes(acts))
    assert deepspeed_config(acts) == deepspeed_config(sample_plan("gpt3-175b"))
    assert not any("compress" in note or "1-bit" in note for note in deepspeed_config_notes(sample_plan("tiny-dp")))


def test_deepspeed_parses_the_zero_plus_plus_flags(monkeypatch):
    config = pytest.importorskip("deepspeed.runtime.config")
    monkeypatch.setattr(config.dist, "get_rank", lambda *args, **kwargs: 0)

    class DataParallelOnly:
        def get_data_parallel_world_size(self) -> int:
            return 2

    plan = sample_plan("tiny-dp", parallel={"zero_stage": 3, "compression": {"weights": "int8", "grad": "int8"}})
    zero = config.DeepSpeedConfig(deepspeed_config(plan), mpu=DataParallelOnly()).zero_config
    assert zero.zero_quantized_weights and zero.zero_quantized_gradients


def test_plans_written_before_compression_still_load():
    data = sample_plan("tiny-dp").model_dump(mode="json")
    del data["parallel"]["compression"], data["compression"]
    plan = Plan.model_validate(data)
    assert plan.parallel.compression == CompressionConfig() and plan.compression.applied is None
    assert "| Compression | off |" in render_reports(plan)["report.md"]


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_compile_and_estimate_take_compress(tmp_path):
    result = _run("compile", GPT_SMALL, "--gpus", 8, "--global-batch", 16, "--compress", "grad=int8",
                  "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    parallel = data["parallel"]
    assert parallel["compression"] == {"grad": "int8", "weights": "none", "activations": "none"}
    assert parallel["zero_stage"] <= 1 and parallel["tp"] == 1
    assert data["compression"]["applied"]["compress"] == "grad=int8"
    written = Plan.model_validate_json((tmp_path / "out" / "plan.json").read_text())
    assert written.pins.compress.grad == "int8" and written.parallel.compression.grad == "int8"

    result = _run("estimate", GPT_SMALL, "--gpus", 8, "--tp", 1, "--pp", 2, "--global-batch", 16, "--compress",
                  "act=int8", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["config"]["compression"]["activations"] == "int8"
    assert data["compression"]["applied"]["compress"] == "act=int8"


@pytest.mark.parametrize("args,needle", [
    (["--compress", "act=int4"], "act takes none or int8"),
    (["--compress", "grad=1bit", "--zero", 2], "needs ZeRO 0 or 1"),
    (["--compress", "weights=int8", "--zero", 2], "needs ZeRO 3"),
    (["--compress", "grad=1bit,act=int8"], "contradict"),
])
def test_bad_compress_fails_cleanly(tmp_path, args, needle):
    out = tmp_path / "out"
    result = _run("compile", GPT_SMALL, "--gpus", 8, *args, "-o", out)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and needle in " ".join(result.output.split())
    assert not out.exists()
