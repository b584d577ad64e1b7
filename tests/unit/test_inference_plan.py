"""Inference planning (zplan.inference_api): the choice for latency and throughput, the precision and tier
fallbacks on a model too big for the GPUs, pins, errors, and the written outputs."""

import json

import jsonschema
import pytest

from zplan.api import write_outputs
from zplan.errors import InfeasibleError, SpecError
from zplan.inference_api import compile_inference_plan, compile_inference_with_alternatives, prepare
from zplan.schemas.alternatives import InferenceAlternatives
from zplan.schemas.export import JSON_DIR
from zplan.schemas.inference import InferencePlan

GPT3 = "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200"  # 175B parameters, learned positions
LLAMA_SMALL = "llama:layers=4,hidden=512,heads=8,kv_heads=2,ffn=1024,seq=256,vocab=1000"
GPT_SMALL = "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000"


def plan(model=GPT3, gpus=8, cluster="dgx-h100", **kw) -> InferencePlan:
    return compile_inference_plan(prepare(model, gpus, cluster, **kw))


def plan_and_search(model=GPT3, gpus=8, cluster="dgx-h100", **kw) -> tuple[InferencePlan, InferenceAlternatives]:
    return compile_inference_with_alternatives(prepare(model, gpus, cluster, **kw))


def test_latency_on_8_h100_keeps_bf16_on_the_gpus_at_the_largest_tp():
    p = plan()
    assert (p.parallel.tp, p.parallel.replicas, p.parallel.weight_precision, p.parallel.weight_tier) == \
        (8, 1, "bf16", "gpu")
    assert (p.spec.batch, p.spec.prompt_len, p.spec.gen_len, p.parallel.max_seq_len) == (1, 512, 128, 640)
    assert p.reason.startswith("Target latency") and "ms per output token" in p.reason
    # 175B bf16 weights over 8 GPUs: at least 350e9 / 8 bytes each; the KV cache by hand: 2*L*B*S*(a/tp)*d*2
    assert p.prediction.memory.weights >= 175e9 * 2 / 8
    assert p.prediction.memory.kv_cache == 2 * 96 * 1 * 640 * (96 // 8) * 128 * 2
    m = p.prediction.memory
    assert m.total == pytest.approx(m.weights + m.kv_cache + m.activations + m.reserve)
    assert p.prediction.request_latency_s == pytest.approx(p.prediction.ttft_s + 127 * p.prediction.tpot_s)


def test_throughput_chooses_the_batch_with_the_most_tokens_per_s():
    latency = plan()
    throughput = plan(target="throughput")
    assert throughput.spec.batch > 1
    assert throughput.prediction.tokens_per_s > latency.prediction.tokens_per_s
    assert throughput.prediction.tpot_s >= latency.prediction.tpot_s
    # independently: compile each power-of-two batch pinned; none that fits unquantized beats the chosen one
    # (a pinned batch too large for bf16 weights is served with int8 weights instead: not a rival)
    best = {}
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        try:
            pinned = plan(target="throughput", batch=batch)
        except InfeasibleError:  # nothing fits this batch at all
            continue
        if pinned.parallel.weight_precision == "bf16":
            best[batch] = pinned.prediction.tokens_per_s
    assert max(best) == throughput.spec.batch == 64
    assert throughput.prediction.tokens_per_s == pytest.approx(max(best.values()))


def test_latency_beats_every_feasible_unquantized_resident_alternative():
    p, s = plan_and_search(cluster="dgx-h200")
    rivals = [c for c in s.alternatives if c.feasible and c.weight_tier == "gpu" and c.weight_precision == "bf16"]
    assert len(rivals) >= 2  # tp 4 and 8 fit 141 GB GPUs
    assert min(c.tpot_s for c in rivals) == pytest.approx(p.prediction.tpot_s)
    assert "the next best" in p.reason and "slower per output token" in p.reason
    assert s.alternatives[0].note == "" and all(c.note for c in s.alternatives[1:])


def test_quantized_only_when_nothing_unquantized_fits():
    # 175B: bf16 350 GB and int8 175 GB exceed 141 GB; int4 ~90 GB fits
    p, s = plan_and_search(gpus=1, cluster="dgx-h200")
    assert (p.parallel.weight_precision, p.parallel.weight_tier) == ("int4", "gpu")
    assert "quantized to int4" in p.reason and "bf16 and int8 weights do not fit" in p.reason
    assert not any(c.feasible for c in s.alternatives if c.weight_tier == "gpu" and c.weight_precision != "int4")


def test_streamed_only_when_nothing_resident_fits():
    # even int4 (~90 GB) exceeds 80 GB: bf16 streamed from host memory
    p, s = plan_and_search(gpus=1, cluster="dgx-h100")
    assert (p.parallel.weight_precision, p.parallel.weight_tier, p.parallel.prefetch_layers) == ("bf16", "cpu", 1)
    assert "stream from host memory" in p.reason
    assert p.prediction.time.decode_stream_s > 0 and p.prediction.memory.cpu_bytes_per_node >= 170e9 * 2
    assert not any(c.feasible for c in s.alternatives if c.weight_tier == "gpu")


def test_pins_are_respected():
    p = plan(tp=4, precision="int8", offload="cpu")
    assert (p.parallel.tp, p.parallel.replicas, p.parallel.weight_precision, p.parallel.weight_tier) == \
        (4, 2, "int8", "cpu")
    assert "as pinned" in p.reason and p.pins.offload == "cpu"
    assert plan(offload="none").pins.offload == "gpu"
    fp32 = plan(GPT_SMALL, gpus=2, cluster="cpu-local", precision="fp32")
    assert (fp32.parallel.compute_dtype, fp32.parallel.weight_precision) == ("fp32", "fp32")


def test_grouped_query_attention_limits_tp_and_has_no_length_cap():
    _, s = plan_and_search(LLAMA_SMALL, gpus=8, cluster="dgx-h100")
    assert {c.tp for c in s.alternatives} == {1, 2}  # tp must divide the 2 KV heads
    long = plan(LLAMA_SMALL, gpus=1, cluster="dgx-h100", prompt_len=500, gen_len=100)  # rotary: beyond seq 256
    assert long.parallel.max_seq_len == 600


@pytest.mark.parametrize("kw,needle", [
    (dict(tp=3), "use one of 1, 2, 4, 8"),
    (dict(prompt_len=2000, gen_len=100), "--gen-len 48 or less"),
    (dict(prompt_len=2048), "--prompt-len 2047 or less"),
    (dict(batch=0), "--batch must be at least 1"),
    (dict(target="fast"), "latency or throughput"),
])
def test_bad_requests_fail_with_the_fix(kw, needle):
    with pytest.raises(SpecError, match=needle):
        prepare(GPT3, 8, "dgx-h100", **kw)


def test_no_bf16_on_v100():
    with pytest.raises(SpecError, match="fp16"):
        prepare(GPT_SMALL, 16, "dgx2-v100", precision="bf16")
    assert prepare(GPT_SMALL, 16, "dgx2-v100").compute_dtype == "fp16"


def test_nothing_fits_names_the_closest_and_what_would_fit():
    with pytest.raises(InfeasibleError) as info:
        plan(gpus=1, offload="none")
    text = str(info.value)
    assert "Closest: tp=1 int4" in text and "GiB" in text
    assert "--offload cpu" in text and "--gpus 2 (the fewest that fit)" in text


def test_outputs_are_deterministic_and_validate(tmp_path):
    p, s = plan_and_search(GPT_SMALL, gpus=2, cluster="cpu-local", precision="fp32")
    first = write_outputs(p, tmp_path / "a", GPT_SMALL, alternatives=s)
    write_outputs(p, tmp_path / "b", GPT_SMALL, alternatives=s)
    names = {f.name for f in first}
    assert {"plan.json", "alternatives.json", "report.md", "report.html"} <= names
    for name in ("plan.json", "alternatives.json", "report.md", "report.html"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    data = json.loads((tmp_path / "a" / "plan.json").read_text())
    jsonschema.validate(data, json.loads((JSON_DIR / "inference_plan.schema.json").read_text()))
    assert InferencePlan.model_validate(data) == p
    search = json.loads((tmp_path / "a" / "alternatives.json").read_text())
    jsonschema.validate(search, json.loads((JSON_DIR / "inference_alternatives.schema.json").read_text()))
    assert InferenceAlternatives.model_validate(search) == s
    report = (tmp_path / "a" / "report.md").read_text()
    for part in ("Time to first token", "KV cache", "## Alternatives", "## Assumptions", "launch/serve.sh", p.reason):
        assert part in report
    html = (tmp_path / "a" / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "<script" not in html and "http" not in html.split("<body>")[1]


def test_the_plan_sizes_the_paged_kv_cache_and_prices_continuous_batching(tmp_path):
    """plan.json's parallel.kv_blocks by hand (the budget's blocks, but no more than max_batch sequences of
    max_seq_len fill), and the curve at 1, 2, 4, ... up to what the blocks hold; its lone request's first token is
    the static plan's prefill of one prompt; the report draws and tabulates the curve."""
    p, s = plan_and_search(LLAMA_SMALL, gpus=1, cluster="dgx-h100", target="throughput", batch=200)
    m, cluster = p.prediction.memory, p.cluster
    # 4 layers, 2 KV heads of 512 / 8 = 64, 16 tokens, bf16: 2 * 4 * 2 * 16 * 64 * 2 bytes a block
    block = 2 * 4 * 2 * 16 * 64 * 2
    budget = 0.95 * (cluster.gpu.hbm_bytes - m.weights - cluster.framework_reserve_bytes)
    curve = p.prediction.continuous_batching
    assert (p.parallel.kv_block_tokens, curve.kv_block_bytes) == (16, block)
    assert curve.kv_budget_bytes == pytest.approx(budget)
    assert p.parallel.kv_blocks == min(int(budget // block), 200 * -(-p.parallel.max_seq_len // 16))
    per_request = -(-(p.spec.prompt_len + p.spec.gen_len) // 16)
    assert curve.blocks_per_request == per_request
    assert curve.max_concurrency == min(200, p.parallel.kv_blocks // per_request) == 200
    levels = [point.concurrency for point in curve.points]
    assert levels[:4] == [1, 2, 4, 8] and levels[-1] == curve.max_concurrency
    assert all(b == 2 * a for a, b in zip(levels[:-2], levels[1:-1], strict=True))
    assert levels[-2] < levels[-1] <= 2 * levels[-2]
    lone = curve.points[0]
    one_at_a_time = plan_and_search(LLAMA_SMALL, gpus=1, cluster="dgx-h100")[0]  # latency: batch 1
    assert lone.ttft_s == pytest.approx(one_at_a_time.prediction.ttft_s)
    assert lone.prefill_steps == 1 and lone.tokens_per_s == pytest.approx(1 / lone.tpot_s)  # one token a step
    write_outputs(p, tmp_path / "out", LLAMA_SMALL, alternatives=s)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Continuous batching" in report and f"{p.parallel.kv_blocks:,} blocks of 16 tokens" in report
    row = f"| 1 | {lone.tokens_per_s:,.1f} |"
    assert row in report and report.count("\n| ") >= len(levels)
    html = (tmp_path / "out" / "report.html").read_text()
    assert '<svg id="chart-serving"' in html and html.count("<circle") >= len(levels)


def test_plans_written_before_the_paged_cache_still_load_and_render(tmp_path):
    p, s = plan_and_search(GPT_SMALL, gpus=2, cluster="cpu-local", precision="fp32")
    data = json.loads(p.model_dump_json())
    del data["parallel"]["kv_blocks"], data["parallel"]["kv_block_tokens"], data["prediction"]["continuous_batching"]
    jsonschema.validate(data, json.loads((JSON_DIR / "inference_plan.schema.json").read_text()))
    old = InferencePlan.model_validate(data)
    assert old.parallel.kv_blocks is None and old.prediction.continuous_batching is None
    assert old.parallel.kv_block_tokens == 16
    write_outputs(old, tmp_path / "old", GPT_SMALL, alternatives=s.model_copy(update={"fingerprint": old.fingerprint}))
    assert "Continuous batching" not in (tmp_path / "old" / "report.md").read_text()
    assert "chart-serving" not in (tmp_path / "old" / "report.html").read_text()
