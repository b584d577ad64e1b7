"""Hand-built plans for codegen tests, until the compiler produces real ones.

`sample_plan("gpt3-175b")`: GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, h=12288, 96 heads,
s=2048) on 64 dgx-a100-80g GPUs, tp=8 x pp=8 x dp=1, interleaved 1F1B with 2 chunks per stage.
`sample_plan("tiny-dp")`: a 4-layer toy GPT, data parallel on 2 GPUs.
`sample_alternatives(name)`: the same sample's search (alternatives.json): its alternatives, rejected families and
assumptions.
`runnable_plan(model_path, ...)`: a plan for a real model file on a few CPU processes, for the tests that
run the emitted train.py.

Overrides are merged into the plan's JSON form (nested dicts merge field by field) and the result is
validated, e.g. `sample_plan("tiny-dp", parallel={"zero_stage": 3, "offload": "nvme"})`.
The numbers are plausible, not predicted: codegen only displays them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cpu_local import CPU_LOCAL
from zplan.schemas import (
    Alternatives,
    Assumption,
    Candidate,
    Fingerprint,
    LayerCost,
    MemoryBreakdown,
    ModelSummary,
    ParallelConfig,
    Pins,
    Placement,
    Plan,
    Prediction,
    RejectedFamily,
    Stage,
    TensorParallelRule,
    TimeBreakdown,
    TrainSpec,
)

GB = 1e9
GiB = 1024**3

_GPT_TP_RULES = [
    TensorParallelRule(module="attn.qkv", style="colwise"),
    TensorParallelRule(module="attn.proj", style="rowwise"),
    TensorParallelRule(module="mlp.fc", style="colwise"),
    TensorParallelRule(module="mlp.proj", style="rowwise"),
]


def _gpt_summary(name: str, layers: int, hidden: int, heads: int, seq: int, vocab: int) -> ModelSummary:
    """Closed-form GPT counts: 12h^2+13h parameters per block, 2 FLOPs per MAC, causal attention."""
    block_params = 12 * hidden * hidden + 13 * hidden
    embedding_params = vocab * hidden + seq * hidden
    head_params = 2 * hidden  # final LayerNorm; the output projection is tied to the embedding
    block_flops = 2 * seq * block_params + 2 * seq * seq * hidden
    block_act_bytes = seq * hidden * (34 + 5 * heads * seq / hidden)  # Korthikanti et al. 2022, eq. 1
    units = [LayerCost(name="wte", kind="embedding", params=embedding_params, fwd_flops=0.0,
                       act_bytes=2.0 * seq * hidden)]
    units += [LayerCost(name=f"blocks.{i}", kind="block", params=block_params, fwd_flops=float(block_flops),
                        act_bytes=float(block_act_bytes)) for i in range(layers)]
    units.append(LayerCost(name="head", kind="head", params=head_params, fwd_flops=2.0 * seq * hidden * vocab,
                           act_bytes=4.0 * seq * vocab))
    return ModelSummary(
        name=name, source="family", tracer="closed-form", num_blocks=layers, hidden=hidden, heads=heads,
        kv_heads=heads, ffn_hidden=4 * hidden, vocab=vocab, seq_len=seq,
        params=sum(unit.params for unit in units), layers=units, block_prefix="blocks",
        tp_rules=_GPT_TP_RULES,
    )


def _stages(model: ModelSummary, chunks: int) -> list[Stage]:
    """Blocks split evenly over the chunks; the embedding joins the first, the head the last."""
    blocks_per_chunk = model.num_blocks // chunks
    stages = []
    for index in range(chunks):
        first = 0 if index == 0 else 1 + index * blocks_per_chunk
        last = len(model.layers) - 1 if index == chunks - 1 else (index + 1) * blocks_per_chunk
        units = model.layers[first:last + 1]
        stages.append(Stage(
            index=index, first_layer=first, last_layer=last, layer_names=[unit.name for unit in units],
            fwd_flops_per_sample=sum(unit.fwd_flops for unit in units),
            params=sum(unit.params for unit in units),
        ))
    return stages


def _prediction(plan_inputs: dict[str, Any], memory: dict[str, float], time: TimeBreakdown) -> Prediction:
    train: TrainSpec = plan_inputs["train"]
    world = plan_inputs["fingerprint"].world_size
    step_time_s = sum(time.model_dump().values())
    tokens = train.global_batch * train.seq_len
    model_flops = 6.0 * plan_inputs["model"].params * tokens
    peak = plan_inputs["cluster"].peak_flops(train.precision)
    parts = ("parameters", "gradients", "optimizer", "activations", "comm_buffers", "reserve")
    total = sum(memory[key] for key in parts)
    breakdown = MemoryBreakdown(**memory, total=total, capacity=float(plan_inputs["cluster"].gpu.hbm_bytes))
    return Prediction(
        step_time_s=step_time_s, tokens_per_s=tokens / step_time_s,
        mfu=model_flops / (step_time_s * world * peak), model_flops_per_step=model_flops,
        memory=breakdown, time=time, feasible=total <= breakdown.capacity,
    )


def _candidate(tp, pp, dp, micro, zero, recompute, sp, interleave, step_s, mem_gb, global_batch) -> Candidate:
    capacity = 80 * GB
    parallel = ParallelConfig(
        tp=tp, pp=pp, dp=dp, micro_batch=micro, num_micro_batches=global_batch // (dp * micro),
        zero_stage=zero, recompute=recompute, sequence_parallel=sp, interleave=interleave,
        schedule="none" if pp == 1 else ("interleaved-1f1b" if interleave > 1 else "1f1b"), offload="none",
    )
    return Candidate(parallel=parallel, step_time_s=step_s, memory_per_gpu_bytes=mem_gb * GB,
                     feasible=mem_gb * GB <= capacity)


def _gpt3_175b() -> dict[str, Any]:
    cluster = BUILTIN_CLUSTERS["dgx-a100-80g"]
    model = _gpt_summary("gpt3-175b", layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
    train = TrainSpec(global_batch=256, seq_len=2048, precision="bf16")
    spec = "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200"
    inputs: dict[str, Any] = {
        "zplan_version": "0.1.0",
        "fingerprint": Fingerprint(model_ref=spec, model_sha256="3f" * 32, cluster=cluster.name,
                                   world_size=64),
        "model": model, "cluster": cluster, "train": train, "pins": Pins(tp=8),
        "parallel": ParallelConfig(tp=8, pp=8, dp=1, micro_batch=1, num_micro_batches=256, zero_stage=1,
                                   recompute="selective", sequence_parallel=True, interleave=2,
                                   schedule="interleaved-1f1b", offload="none"),
        "stages": _stages(model, chunks=16),
        "placement": Placement(parameters="gpu", gradients="gpu", optimizer="gpu"),
        "candidates_evaluated": 18432,
    }
    time = TimeBreakdown(compute=48.0, tensor_parallel=4.2, pipeline_bubble=0.7, pipeline_p2p=0.9,
                         data_parallel=0.0, offload=0.0, optimizer=0.25)
    memory = {"parameters": 5.6 * GB, "gradients": 5.6 * GB, "optimizer": 33.6 * GB, "activations": 10.3 * GB,
              "comm_buffers": 1.5 * GB, "reserve": 2.0 * GiB, "cpu_bytes_per_node": 0.0,
              "nvme_bytes_per_node": 0.0}
    inputs["prediction"] = _prediction(inputs, memory, time)
    rows = [  # tp, pp, dp, micro, zero, recompute, sp, interleave, step_s, mem_gb
        (8, 8, 1, 1, 1, "selective", True, 1, 55.1, 56.2), (8, 8, 1, 2, 1, "selective", True, 2, 54.6, 69.8),
        (8, 8, 1, 1, 1, "full", True, 2, 63.9, 49.7), (8, 8, 1, 2, 1, "full", True, 1, 62.5, 52.3),
        (8, 4, 2, 1, 1, "full", True, 1, 66.0, 71.5), (8, 4, 2, 1, 3, "full", True, 1, 71.8, 44.0),
        (8, 4, 2, 1, 2, "full", True, 1, 68.7, 57.9), (8, 4, 2, 1, 1, "selective", True, 2, 57.4, 92.3),
        (4, 16, 1, 1, 1, "selective", True, 1, 60.3, 47.9), (4, 16, 1, 1, 1, "full", True, 1, 69.5, 39.1),
        (4, 8, 2, 1, 2, "full", True, 1, 71.3, 76.8), (4, 8, 2, 1, 3, "full", True, 1, 78.0, 42.6),
        (2, 16, 2, 1, 3, "full", False, 1, 96.4, 61.0), (8, 2, 4, 1, 3, "full", True, 1, 83.2, 58.8),
        (8, 2, 4, 1, 1, "full", True, 1, 74.1, 128.4), (1, 64, 1, 1, 1, "full", False, 1, 142.0, 38.2),
    ]
    inputs["alternatives"] = [_candidate(*row, global_batch=train.global_batch) for row in rows]
    inputs["rejected"] = [
        RejectedFamily(family="pp=1 (no pipeline)", reason="memory",
                       detail="Best member tp=8 dp=8 ZeRO-3 needs 96.3 GB per GPU, 16.3 GB over 80 GB HBM."),
        RejectedFamily(family="tp=16", reason="communication",
                       detail="tp=16 crosses nodes: its all-reduces on 25 GB/s InfiniBand add 41 s."),
        RejectedFamily(family="pp=32", reason="illegal",
                       detail="96 blocks over 32 stages x 2 chunks leaves 1.5 blocks per chunk."),
        RejectedFamily(family="pp=16, interleave=1", reason="bubble",
                       detail="Bubble of 15/256 of compute (2.8 s) against 0.7 s interleaved at pp=8."),
    ]
    inputs["assumptions"] = _nvidia_assumptions() + [
        Assumption(name="Activation memory", value="34 sbh + 5 as^2 b bytes per layer, /t with SP",
                   source="Korthikanti et al. 2022, eq. 2-4"),
    ]
    return inputs


def _nvidia_assumptions() -> list[Assumption]:
    return [
        Assumption(name="GEMM efficiency", value="0.80 x GEMM/(GEMM + 2.0 GFLOP) of peak",
                   source="cuBLAS large-GEMM measurements (assumed)"),
        Assumption(name="NVLink collective efficiency", value="0.80 of 300 GB/s",
                   source="nccl-tests bus bandwidth"),
        Assumption(name="InfiniBand collective efficiency", value="0.90 of 25 GB/s",
                   source="nccl-tests bus bandwidth"),
        Assumption(name="Adam optimizer states", value="12 bytes per parameter (fp32 master, m, v)",
                   source="Rajbhandari et al. 2020 (ZeRO), section 3.1"),
        Assumption(name="Framework reserve", value="2.00 GiB per GPU", source="cluster profile"),
    ]


def _tiny_dp() -> dict[str, Any]:
    cluster = BUILTIN_CLUSTERS["dgx-a100-80g"]
    model = _gpt_summary("tiny", layers=4, hidden=64, heads=4, seq=64, vocab=256)
    train = TrainSpec(global_batch=8, seq_len=64, precision="fp32")
    inputs: dict[str, Any] = {
        "zplan_version": "0.1.0",
        "fingerprint": Fingerprint(model_ref="examples/tiny.py", model_sha256="a1" * 32, cluster=cluster.name,
                                   world_size=2),
        "model": model, "cluster": cluster, "train": train, "pins": Pins(),
        "parallel": ParallelConfig(tp=1, pp=1, dp=2, micro_batch=4, num_micro_batches=1, zero_stage=0,
                                   recompute="none", sequence_parallel=False, interleave=1, schedule="none",
                                   offload="none"),
        "stages": _stages(model, chunks=1),
        "placement": Placement(parameters="gpu", gradients="gpu", optimizer="gpu"),
        "candidates_evaluated": 12,
    }
    params = model.params
    time = TimeBreakdown(compute=2.1e-4, tensor_parallel=0.0, pipeline_bubble=0.0, pipeline_p2p=0.0,
                         data_parallel=3.5e-5, offload=0.0, optimizer=1.2e-5)
    memory = {"parameters": 4.0 * params, "gradients": 4.0 * params, "optimizer": 8.0 * params,
              "activations": 3.1e6, "comm_buffers": 2.5e7, "reserve": 2.0 * GiB, "cpu_bytes_per_node": 0.0,
              "nvme_bytes_per_node": 0.0}
    inputs["prediction"] = _prediction(inputs, memory, time)
    inputs["alternatives"] = [
        _candidate(1, 1, 2, 2, 0, "none", False, 1, 2.71e-4, 2.16, 8),
        _candidate(1, 1, 2, 4, 1, "none", False, 1, 2.69e-4, 2.16, 8),
        _candidate(1, 2, 1, 4, 0, "none", False, 1, 4.02e-4, 2.16, 8),
        _candidate(2, 1, 1, 4, 0, "none", False, 1, 3.55e-4, 2.15, 8),
    ]
    inputs["rejected"] = [
        RejectedFamily(family="tp=2", reason="communication",
                       detail="Two all-reduces per block cost 0.09 ms, the gradient all-reduce 0.04 ms."),
        RejectedFamily(family="pp=2", reason="bubble", detail="One micro-batch per step: the bubble is 50%."),
    ]
    inputs["assumptions"] = _nvidia_assumptions()
    return inputs


SAMPLES = {"gpt3-175b": _gpt3_175b, "tiny-dp": _tiny_dp}


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = _merge(base[key], value) if key in base else value
        return merged
    return override


SEARCH_FIELDS = ("candidates_evaluated", "alternatives", "rejected", "assumptions")  # alternatives.json's


def _validated(schema: Any, data: dict[str, Any], overrides: dict[str, Any]) -> Any:
    for key, value in overrides.items():
        if hasattr(value, "model_dump"):
            value = value.model_dump(mode="json")
        data[key] = _merge(data[key], value) if key in data else value
    return schema.model_validate(data)


def sample_plan(name: str = "gpt3-175b", **overrides: Any) -> Plan:
    """A validated Plan; `overrides` replace top-level fields, nested dicts merge field by field."""
    inputs = {key: value for key, value in SAMPLES[name]().items() if key not in SEARCH_FIELDS}
    return _validated(Plan, Plan(**inputs).model_dump(mode="json"), overrides)


def sample_alternatives(name: str = "gpt3-175b", **overrides: Any) -> Alternatives:
    """The sample's search as alternatives.json holds it; `overrides` as sample_plan's (a `fingerprint` override
    must match the plan it goes with)."""
    inputs = SAMPLES[name]()
    search = Alternatives(fingerprint=inputs["fingerprint"], **{key: inputs[key] for key in SEARCH_FIELDS})
    return _validated(Alternatives, search.model_dump(mode="json"), overrides)


# ---- plans that run: a model file on tp x dp CPU processes -------------------------------------------


def gpt_unit_names(layers: int) -> list[str]:
    """The units of the runtime tests' tiny GPTs, in order: embeddings, blocks, final norm, head."""
    return ["wte", "wpe", *(f"blocks.{i}" for i in range(layers)), "ln_f", "head"]


def runnable_plan(model_ref: str | Path, *, units: list[str], hidden: int, heads: int, vocab: int, seq_len: int,
                  micro_batch: int, num_micro_batches: int, tp: int = 1, dp: int = 1, zero_stage: int = 0,
                  recompute: str = "none", sequence_parallel: bool = False, precision: str = "fp32",
                  kv_heads: int | None = None, ffn_hidden: int | None = None,
                  tp_rules: dict[str, str] | None = None, name: str = "tiny-gpt", source: str = "file",
                  model_sha256: str | None = None) -> Plan:
    """A hand-made plan, one pipeline stage on CPU_LOCAL: the fields the runtime reads are real, the
    predictions are placeholders. The fingerprint hashes the file `model_ref` unless `model_sha256` is
    given (a family spec); units named blocks.* are the blocks; ZeRO (and tp when > 1) count as pinned."""
    if model_sha256 is None:
        model_sha256 = hashlib.sha256(Path(model_ref).read_bytes()).hexdigest()
    layers = [LayerCost(name=n, kind="block" if n.startswith("blocks") else "other", params=0, fwd_flops=0.0,
                        act_bytes=0.0) for n in units]
    return Plan(
        zplan_version="test",
        fingerprint=Fingerprint(model_ref=str(model_ref), model_sha256=model_sha256, cluster=CPU_LOCAL.name,
                                world_size=tp * dp),
        model=ModelSummary(
            name=name, source=source, tracer="hand", num_blocks=sum(unit.kind == "block" for unit in layers),
            hidden=hidden, heads=heads, kv_heads=kv_heads or heads, ffn_hidden=ffn_hidden or 4 * hidden,
            vocab=vocab, seq_len=seq_len, params=1, layers=layers, block_prefix="blocks",
            tp_rules=[TensorParallelRule(module=m, style=s) for m, s in (tp_rules or {}).items()],
        ),
        cluster=CPU_LOCAL,
        train=TrainSpec(global_batch=micro_batch * num_micro_batches * dp, seq_len=seq_len, precision=precision),
        pins=Pins(zero=zero_stage, tp=tp if tp > 1 else None),
        parallel=ParallelConfig(
            tp=tp, pp=1, dp=dp, micro_batch=micro_batch, num_micro_batches=num_micro_batches,
            zero_stage=zero_stage, recompute=recompute, sequence_parallel=sequence_parallel, interleave=1,
            schedule="none", offload="none",
        ),
        stages=[Stage(index=0, first_layer=0, last_layer=len(units) - 1, layer_names=list(units),
                      fwd_flops_per_sample=0.0, params=0)],
        placement=Placement(parameters="gpu", gradients="gpu", optimizer="gpu"),
        prediction=Prediction(step_time_s=0.01, tokens_per_s=1.0, mfu=0.01, model_flops_per_step=1e6,
                              memory=MemoryBreakdown(**dict.fromkeys(set(MemoryBreakdown.model_fields) - {"terms"},
                                                                     0.0)),
                              time=TimeBreakdown(**dict.fromkeys(TimeBreakdown.model_fields, 0.0)),
                              feasible=True),
    )
