"""The plan: the only contract between compile time and run time (docs/design.md decision 1).

plan.json holds what the runtime executes and what it was predicted to do; what the search scored besides it (the
alternatives and why other families lost) and what the prediction assumed are alternatives.json beside it
(schemas.alternatives)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.frozen import Frozen
from zplan.schemas.model import ModelSummary
from zplan.schemas.spec import CompressionConfig, Pins, Recompute, Tier, TrainSpec

PLAN_SCHEMA_VERSION = 2  # 2: the search's alternatives moved out to alternatives.json (schemas.alternatives)
MAX_PLAN_FILE_BYTES = 64 << 20  # bytes, of plan.json and of alternatives.json; a 175B model's are under 1 MiB
Schedule = Literal["none", "1f1b", "interleaved-1f1b"]
DelayedUpdateMode = Literal["auto", "on", "off"]



class Fingerprint(Frozen):
    """What the plan was made for; the runtime refuses a run that differs."""

    model_ref: str = Field(description="Model path or family spec as given on the command line.")
    model_sha256: str = Field(description="SHA-256 of the model file's bytes (of a Hugging Face folder's "
                                          "config.json), or of the family spec string.")
    cluster: str = Field(description="Cluster profile name.")
    world_size: int = Field(gt=0, description="Number of GPUs (processes) the plan needs.")
    init_from: Optional[str] = Field(default=None, description="The weights train.py starts from by default, "
                                     "relative to the model: a Hugging Face folder's model.safetensors.index.json "
                                     "or model.safetensors; null: the model's own initialisation.")


class ParallelConfig(Frozen):
    tp: int = Field(gt=0, description="Tensor-parallel degree (innermost mesh dim).")
    pp: int = Field(gt=0, description="Pipeline stages.")
    dp: int = Field(gt=0, description="Data-parallel replicas (mesh order pp, dp, cp, tp: tp innermost).")
    cp: int = Field(default=1, gt=0, description="Context-parallel degree: each sequence split over cp GPUs (2 * cp "
                                                  "chunks, rank r holding chunks r and 2cp-1-r); the gradients are "
                                                  "reduced and ZeRO shards over dp * cp.")
    ep: int = Field(default=1, gt=0, description="Expert-parallel degree: each MoE block's routed experts split over "
                    "ep consecutive data-parallel ranks (E / ep each), tokens dispatched to them by all-to-all; 1 for "
                    "a dense model.")
    micro_batch: int = Field(gt=0, description="Sequences per micro-batch per data-parallel rank.")
    num_micro_batches: int = Field(gt=0, description="Micro-batches per step (gradient accumulation).")
    zero_stage: Literal[0, 1, 2, 3] = Field(description="ZeRO stage over the data-parallel dim.")
    recompute: Recompute = Field(description="Activation recompute mode.")
    sequence_parallel: bool = Field(description="Megatron sequence parallelism (needs tp > 1).")
    vocab_parallel: bool = Field(
        default=False, description="The token embedding and the output head split by vocabulary rows over tp "
                                   "(Megatron's VocabParallelEmbedding and parallel cross-entropy): each tp rank "
                                   "holds V/tp rows of each table and (B, T, V/tp) logits, the loss computed with "
                                   "the max and the sum all-reduced (torch's loss_parallel). False: both replicated "
                                   "over tp (plans from before it, tp 1, or a model whose embedding or head is not "
                                   "an nn.Embedding / nn.Linear over the vocabulary).")
    interleave: int = Field(gt=0, description="Model chunks per pipeline stage (1: plain 1F1B).")
    schedule: Schedule = Field(description="Pipeline schedule.")
    offload: Tier = Field(description=(
        "Where optimizer states live: none=GPU (the placement says where parameters and gradients live)."))
    delayed_update: bool = Field(
        default=False, description="One-step delayed parameter update of ZeRO-Offload (Ren et al., USENIX ATC'21, "
                                   "Sec. 5.2): the CPU optimizer step of iteration i overlaps the forward and "
                                   "backward of iteration i+1, which use the weights from before that step. Only "
                                   "with ZeRO-1 and the optimizer offloaded to the CPU.")
    compression: CompressionConfig = Field(default_factory=CompressionConfig, description="Compressed "
                                           "communication (--compress); default: nothing compressed.")

    def pin_flags(self) -> str:
        """The command-line pins that compile exactly this layout, e.g. '--tp 8 --pp 2 --dp 4 --zero 1 ...'."""
        cp = f" --cp {self.cp}" if self.cp > 1 else ""
        return (f"--tp {self.tp} --pp {self.pp} --dp {self.dp}{cp} --zero {self.zero_stage} --offload {self.offload} "
                f"--micro-batch {self.micro_batch} --recompute {self.recompute} "
                f"--{'' if self.sequence_parallel else 'no-'}sequence-parallel --interleave {self.interleave}")


class Stage(Frozen):
    index: int = Field(ge=0, description="Pipeline stage (with interleave: model chunk) index.")
    first_layer: int = Field(ge=0, description="Index of the first unit in ModelSummary.layers.")
    last_layer: int = Field(ge=0, description="Index of the last unit (inclusive).")
    layer_names: list[str] = Field(description="Module paths of the units, first to last.")
    fwd_flops_per_sample: float = Field(ge=0, description="Forward FLOPs of the stage for one sample.")
    params: int = Field(ge=0, description="Parameters held by the stage (before tp/ZeRO sharding).")


class Placement(Frozen):
    """Where each kind of model state lives, from planner.placement (CP-SAT)."""

    parameters: Literal["gpu", "cpu", "nvme"] = Field(description="Tier of the fp16/bf16 parameters.")
    gradients: Literal["gpu", "cpu", "nvme"] = Field(description="Tier of the gradients.")
    optimizer: Literal["gpu", "cpu", "nvme"] = Field(description="Tier of fp32 master weights and Adam moments.")
    host_device_bytes_per_step: float = Field(default=0.0, ge=0, description="Bytes one GPU moves to and from host "
                                              "memory per step for the offloaded states.")
    host_device_s: float = Field(default=0.0, ge=0, description="Time of that host-device traffic per step, s.")
    nvme_bytes_per_step: float = Field(default=0.0, ge=0, description="Bytes one GPU's states read from and write "
                                       "to NVMe per step.")
    nvme_s: float = Field(default=0.0, ge=0, description="Time of that NVMe traffic per step (its share of the "
                          "node's disk bandwidth), s.")
    cpu_optimizer_s: float = Field(default=0.0, ge=0, description="Time of the optimizer step on the CPU per step, s.")


class DelayedUpdate(Frozen):
    """Why the planner turned the delayed parameter update (ParallelConfig.delayed_update) on or off."""

    requested: DelayedUpdateMode = Field(default="auto", description="--delayed-update as given: auto lets the "
                                         "planner decide; on and off force it.")
    cpu_step_s: float = Field(default=0.0, ge=0, description="The CPU optimizer step per step the delay would "
                              "overlap, s (0: none, nothing offloaded to the CPU).")
    window_s: float = Field(default=0.0, ge=0, description="Forward and backward per step (compute, tensor-parallel "
                            "collectives, pipeline bubble and point-to-point) the CPU step can run beside, s.")
    saved_s: float = Field(default=0.0, ge=0, description="Seconds per step the overlap saves, min(cpu_step_s, "
                           "window_s) where it can overlap; taken off the predicted step when on, what it would "
                           "save when off.")
    reason: str = Field(default="", description="Why it is on or off, one sentence with the numbers.")


class CompressionOption(Frozen):
    """One --compress setting priced by the cost model on the chosen configuration (planner.compression)."""

    compress: str = Field(description="The --compress value, e.g. 'grad=int8'.")
    step_time_s: float = Field(description="Predicted seconds per step with it.")
    saved_s: float = Field(description="Seconds per step it saves against the same configuration without it "
                           "(negative: it makes the step slower).")
    wire_bytes: float = Field(ge=0, description="Bytes one GPU sends per step in the collectives it compresses, "
                              "compressed.")
    uncompressed_wire_bytes: float = Field(ge=0, description="Bytes the same collectives send per step "
                                           "uncompressed.")
    fits: bool = Field(description="The configuration still fits memory with it.")


class CompressionDecision(Frozen):
    """What compression does for the plan: the effect of --compress when given, and when data-parallel
    communication takes a large share of the step, what the options the configuration supports would save."""

    data_parallel_share: float = Field(default=0.0, ge=0, description="Share of the step in data-parallel / ZeRO "
                                       "collectives without compression.")
    applied: Optional[CompressionOption] = Field(default=None, description="The plan's --compress, priced against "
                                                 "the same configuration without it; None: nothing compressed.")
    suggestions: list[CompressionOption] = Field(default_factory=list, description="Options the configuration "
                                                 "supports, priced, when the data-parallel share reaches the "
                                                 "threshold (planner.compression.SUGGEST_DATA_PARALLEL_SHARE).")
    reason: str = Field(default="", description="What it saves or would save, one or two sentences with the numbers.")


# The named terms of a GPU's memory peak (MemoryBreakdown.terms; planner.cost.memory computes them), in order, with
# what each is and the coarse part of MemoryBreakdown it belongs to
MEMORY_TERMS: dict[str, str] = {
    "weights": "parameters",
    "gradients": "gradients",
    "optimizer states": "optimizer: fp32 master weights and Adam moments",
    "block activations": "activations: the blocks' saved tensors of the micro-batches in flight, their stage outputs",
    "logits and loss": "activations: the (b, s, V / tp) logits and the loss's fp32 temporaries",
    "collective buffers": "comm buffers: DDP / FSDP2 buckets, gathered blocks, sequence-parallel and all-to-all "
                          "buffers, compression's",
    "compute copies": "comm buffers: autocast's and ZeRO-2/3's compute-dtype copies of the weights",
    "pipeline receive buffers": "comm buffers: hidden states and gradients received from the neighbouring stages",
    "tied table gradient": "comm buffers: a tied embedding's gradient summed over the pipeline ranks that hold it",
    "vocabulary table gradient": "comm buffers: a (V / tp, h) table's whole gradient before it joins its bucket",
    "root unit reduce": "comm buffers: ZeRO 2/3's reduce of the embedding, final norm and head",
    "low-precision cast temporaries": "comm buffers: fp8 / nvfp4 casts' fp32 temporaries in a Linear's backward",
    "framework reserve": "reserve: CUDA context, NCCL, allocator",
    "not live at the peak": "the parts above that do not coincide with the peak (negative)",
}


class MemoryBreakdown(Frozen):
    """Bytes per GPU on the most loaded pipeline stage."""

    parameters: float = Field(description="Parameter bytes.")
    gradients: float = Field(description="Gradient bytes.")
    optimizer: float = Field(description="fp32 master weights + Adam moments.")
    activations: float = Field(description="Activations of all in-flight micro-batches, plus logits.")
    comm_buffers: float = Field(description="Collective buffers and parameters gathered for compute (ZeRO-2: the "
                                "stage's, held from forward to backward; ZeRO-3: two units').")
    reserve: float = Field(description="Framework reserve (context, allocator).")
    not_at_peak: float = Field(default=0.0, description="Bytes of the parts above that are not live at the peak "
                               "moment: the loss's temporaries and the backward's buffers never coincide.")
    total: float = Field(description="The peak: the sum of the above minus not_at_peak.")
    capacity: float = Field(description="Device memory.")
    cpu_bytes_per_node: float = Field(description="Host bytes used by offloaded states, per node.")
    nvme_bytes_per_node: float = Field(description="NVMe bytes used by offloaded states, per node.")
    terms: dict[str, float] = Field(default_factory=dict, description="The peak by named term, bytes (weights, "
                                    "gradients, optimizer states, block activations, logits and loss, collective "
                                    "buffers, compute copies, pipeline receive buffers, ..., framework reserve, less "
                                    "what is not live at the peak): they add up to total (MEMORY_TERMS says what each "
                                    "is). Empty in plans from before it.")


class TimeBreakdown(Frozen):
    """Seconds per optimizer step; the parts add up to step_time_s."""

    compute: float = Field(description="Forward, backward and recompute on the slowest stage.")
    tensor_parallel: float = Field(description="Tensor-parallel collectives, not overlapped.")
    context_parallel: float = Field(default=0.0, description="Context-parallel K/V all-gathers and gradient "
                                    "reduce-scatters, not overlapped (0 when cp = 1).")
    expert_parallel: float = Field(default=0.0, description="Expert-parallel all-to-alls (tokens to their experts "
                                   "and back, forward and backward), not overlapped (0 when ep = 1).")
    pipeline_bubble: float = Field(description="Pipeline fill and drain.")
    pipeline_p2p: float = Field(description="Stage-to-stage activation transfers (with act=int8 compression: "
                                "the compressed bytes plus quantizing and dequantizing them).")
    data_parallel: float = Field(description="Data-parallel / ZeRO collectives not hidden behind backward (with "
                                 "grad or weights compression: the compressed bytes plus quantizing and "
                                 "dequantizing them).")
    offload: float = Field(description="Host/NVMe transfers and the CPU optimizer step, not overlapped (with the "
                           "delayed parameter update: less the part of the CPU step hidden behind compute).")
    optimizer: float = Field(description="Optimizer step on the GPU.")


def intervals_overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two predictions' [low, high] intervals share a point: the cost model cannot tell them apart (a
    near-tie)."""
    return a[0] <= b[1] and b[0] <= a[1]


class PredictionInterval(Frozen):
    """How sure a prediction is (planner/uncertainty.py): an 80 % interval from the cost model's errors on published
    runs of the plan's regime that it was not fitted on (benchmarks/validate_cost_model.py, left one source out)."""

    level: float = Field(description="The share of runs the interval is meant to hold, e.g. 0.8.")
    regime: str = Field(description="The kind of layout whose errors it is built from, e.g. 'dense FSDP'.")
    basis: Literal["validation", "thin", "unseen", "calibration"] = Field(
        description="validation: the regime's own errors; thin: too few runs, the pooled errors' wider range; "
                    "unseen: no run of the regime, wider still; calibration: the user's own runs (zplan calibrate).")
    runs: int = Field(ge=0, description="Runs the interval is built from.")
    step_time_s: tuple[float, float] = Field(description="[low, high] seconds per optimizer step.")
    tokens_per_s: tuple[float, float] = Field(description="[low, high] global tokens per second.")
    mfu: tuple[float, float] = Field(description="[low, high] model FLOPs utilisation.")
    memory_bytes: tuple[float, float] = Field(description="[low, high] peak bytes per GPU, from the dry run's "
                                                          "agreement with the memory model.")
    note: str = Field(description="One line on what the interval rests on.")

    def overlaps(self, step_time_s: tuple[float, float]) -> bool:
        """Whether another prediction's [low, high] step seconds share a point with this one's: the cost model cannot
        tell their plans apart (a near-tie)."""
        return intervals_overlap(self.step_time_s, step_time_s)


class Prediction(Frozen):
    step_time_s: float = Field(description="Predicted seconds per optimizer step.")
    tokens_per_s: float = Field(description="Global tokens per second.")
    mfu: float = Field(description="Model FLOPs utilisation: model FLOPs / (time * gpus * peak).")
    model_flops_per_step: float = Field(description="6*N*tokens-style model FLOPs (no recompute).")
    memory: MemoryBreakdown = Field(description="Per-GPU memory on the most loaded stage.")
    time: TimeBreakdown = Field(description="Where the step time goes.")
    feasible: bool = Field(description="Fits device, host and NVMe capacity.")
    interval: Optional[PredictionInterval] = Field(default=None, description="How sure the figures above are.")


class Assumption(Frozen):
    """One number the prediction assumed (alternatives.json; schemas.alternatives)."""

    name: str = Field(description="What is assumed.")
    value: str = Field(description="The value used, with units.")
    source: str = Field(description="Where it comes from.")


class RankVerification(Frozen):
    """One kind of rank as the dry run measured it (zplan.dryrun)."""

    rank: int = Field(ge=0, description="Global rank dry-run (dp rank 0, tp rank 0 of its stage).")
    stage: int = Field(ge=0, description="Pipeline stage.")
    role: str = Field(description="What the rank holds, e.g. 'stage 0 of 2 (embedding)'.")
    measured_peak_bytes: int = Field(ge=0, description="Peak allocated bytes over the dry run's steps.")
    predicted_peak_bytes: float = Field(description="The plan's total minus its framework reserve.")
    capacity_bytes: float = Field(description="Device memory minus the framework reserve.")
    by_category: dict[str, int] = Field(description="Measured bytes near the peak: parameters, gradients, "
                                                    "optimizer, activations, temporaries.")
    host_peak_bytes: int = Field(ge=0, description="Offloaded states in host memory, peak.")


class Verification(Frozen):
    """`zplan compile --verify`: the plan's program run on fake tensors at its world size (zplan.dryrun)."""

    method: str = Field(description="How the numbers were obtained.")
    torch_version: str = Field(description="torch the dry run ran on.")
    steps: int = Field(gt=0, description="Optimizer steps per rank.")
    ranks: list[RankVerification] = Field(description="The pipeline's end stages' ranks.")
    max_rel_error: float = Field(description="|predicted - measured| / measured on the most loaded rank.")
    fits: bool = Field(description="Every rank's measured peak within its capacity.")
    seconds: float = Field(description="Wall time of the dry run.")


class Plan(Frozen):
    schema_version: int = Field(default=PLAN_SCHEMA_VERSION, description="Plan format version.")
    zplan_version: str = Field(description="zplan version that wrote the plan.")
    fingerprint: Fingerprint = Field(description="Inputs the plan was made for.")
    model: ModelSummary = Field(description="The traced or closed-form model.")
    cluster: ClusterSpec = Field(description="The hardware profile, copied in full.")
    train: TrainSpec = Field(description="Batch, sequence and precision.")
    pins: Pins = Field(description="What the user fixed.")
    parallel: ParallelConfig = Field(description="The chosen configuration.")
    stages: list[Stage] = Field(description="Pipeline stages (pp * interleave chunks) in order.")
    placement: Placement = Field(description="Tier of each model state.")
    delayed_update: DelayedUpdate = Field(default_factory=DelayedUpdate, description="The planner's decision on "
                                          "the delayed parameter update and its reason.")
    compression: CompressionDecision = Field(default_factory=CompressionDecision, description="What --compress "
                                             "saves, or what it would save where data-parallel communication "
                                             "takes a large share of the step.")
    prediction: Prediction = Field(description="Predicted time and memory.")
    verification: Optional[Verification] = Field(default=None, description="The dry run's measurement "
                                                 "(`zplan compile --verify`), or null when not run.")
