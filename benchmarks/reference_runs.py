"""Published measured training runs (../shared/reference: published_runs.csv, training_runs.csv) as zplan requests.

    runs, refused = load_reference_runs(reference_dir)   # ReferenceRun each, and {row label: reason} for the rest

A row is expressible when zplan can state its configuration: a built-in profile for its GPU, a precision the cost
model prices (bf16 / fp16 mixed, fp8 in any of its scalings, NVFP4), the parallel layout and global batch printed
(dp = gpus / (tp * pp * cp)), and a measured time: the iteration time, else tokens/s per GPU, else TFLOP/s per GPU
with the FLOPs formula the source names; a row that prints no precision is mixed 16-bit unless its table's footnote
names the format (printed_precision)
(Narayanan et al. SC'21 Eq. 3 for Megatron 2021 and DeepSpeed: counts the recomputed forward; Megatron-LM's README
counts model FLOPs, 72 B s l h^2 (1 + s/(6h) + V/(12 h l)), Korthikanti et al. 2023; NeMo's Llama rows count
B s L h^2 (12 + 12 G/A + 18 F/h + 12 s/h + 6 V/(L h)), its nemo/utils/flops_formulas.py). Each row's software stack (the
`stack` key) is named from its source and data-parallel column; the validation fits a few constants per stack
(benchmarks/validate_cost_model.py), nothing per row. NeMo's virtual pipeline size (VP=N in the notes) is pinned as
the interleave; where it does not split the blocks evenly (Llama 3.1 405B's 126 blocks), zplan counts the embedding
and the head as a block each, as Megatron-Core's recipes do (planner.search.interleaved_partition).

    moe_runs, moe_refused = load_moe_runs(reference_dir)   # moe_runs.csv, the same way (kind "moe")

moe_runs.csv (Megatron-Bridge's mixture-of-experts rows, all the megatron-core stack), with the rest of its tables'
rows from 25.11 to 26.08 added here (ADDED_MOE_RUNS, benchmarks/moe_runs_added.csv): each row's model is its
architecture's model file under benchmarks/moe_models/ (DeepSeek-V3 and Kimi K2: DeepseekV3Config; Qwen3 MoE:
Qwen3MoeConfig; GPT-OSS: GptOssConfig) at the row's sizes (layers, dense_layers, hidden, heads, kv_heads, dense_ffn,
routed/shared experts, top_k, expert_ffn, vocab, and what the attention column prints: MLA ranks, head_dim, sliding
window), written as a one-function model file per row into a temporary folder (zplan.api.prepare takes a model file).
The layout: tp, pp, cp, dp = gpus / (tp pp cp), interleave = vp (blank: 1), ep, micro-batch and global batch as
printed; fsdp 0 is Megatron's distributed optimizer (zero_stage: ZeRO-1); recompute is not printed and is pinned to
none, as the dense Megatron-Bridge rows that print none are; bf16 -> bf16, any fp8 (blockwise, current scaling,
MXFP8) -> fp8. The measured time is global_batch * seq_len / (tokens_per_s_per_gpu * gpus). Refused: an ep that does
not divide dp or the routed experts (Megatron's MoE parallel folding lets ep span tensor-parallel ranks; zplan's ep
ranks are data-parallel ranks). Kept with a caveat: Kimi K2's Muon optimizer (zplan prices AdamW: its step and its
two fp32 moments; Muon keeps one and adds Newton-Schulz iterations, about 2 % of the step's FLOPs at 1T parameters
and 4096 x 4096 tokens).
"""

from __future__ import annotations

import atexit
import csv
import functools
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from zplan.schemas.spec import Pins

GPU_CLUSTERS = [  # (pattern in gpu_type, built-in profile)
    (r"^A100 40GB", "dgx-a100-40g"),
    (r"^A100", "dgx-a100-80g"),  # 80GB, Azure NDm v4 (80GB), Selene; "memory not stated": the common 80GB
    (r"^H100", "dgx-h100"),
    (r"^H200", "dgx-h200"),
    (r"^B200", "dgx-b200"),
    (r"^GB200", "gb200-nvl72"),
    (r"^GB300", "gb300-nvl72"),
    (r"^V100", "dgx2-v100"),
]
PRICED_PRECISIONS = ("bf16", "fp16", "not printed (fp16/bf16 mixed)", "")


@dataclass(frozen=True)
class ReferenceRun:
    label: str  # source: model, GPUs
    source: str
    stack: str  # megatron-2021, megatron-core, deepspeed, fsdp1, fsdp2
    spec: str  # family spec (planner/family.py)
    cluster: str
    gpus: int
    global_batch: int
    precision: str
    pins: Pins
    measured_s: float  # iteration time
    kind: str = "dense"  # dense, or moe (moe_runs.csv)
    published_params_b: tuple[float, float] | None = None  # moe: (total, active) billions as the row prints them
    caveat: str = ""  # what zplan prices differently from the run (moe: Kimi K2's Muon optimizer)
    published_flops_per_token: float | None = None  # moe: tflops_per_gpu / tokens_per_s_per_gpu, as the row counts
    assumed: str = ""  # what the row does not print that it is priced with (optimizer sharding, precision)
    recompute_printed: bool = True  # False: the row prints no recompute (pinned none for its time)
    recipe_hides: tuple[str, ...] = ()  # time_breakdown parts its recipe hides beyond its stack (MOE_RECIPES)
    dispatch: str = "all_to_all"  # ExpertsSummary.dispatch as its recipe runs it (MOE_RECIPES)


def stack_of(source: str, data_parallel: str) -> str:
    if "FSDP2" in source or "FSDP2" in data_parallel:
        return "fsdp2"
    if "FSDP1" in data_parallel or "fms-fsdp" in source or "llm-foundry" in source:
        return "fsdp1"
    if source == "DeepSpeed":
        return "deepspeed"
    if "Korthikanti" in source or "Narayanan" in source:
        return "megatron-2021"
    return "megatron-core"


# What a run priced with its stack's default optimizer sharding says (ReferenceRun.assumed): Megatron-Core's DDP under
# NeMo's and Megatron-Bridge's recipes and Megatron-LM's performance scripts runs the distributed optimizer
# (--use-distributed-optimizer: the fp32 master weights and Adam moments sharded over dp, ZeRO-1) unless told not to
STACK_DEFAULT_OPTIMIZER = {"megatron-core": (1, "optimizer sharding not printed: priced as Megatron-Core's default, "
                                                "the distributed optimizer (ZeRO-1)")}


def zero_stage(data_parallel: str, stack: str = "") -> tuple[int, str, str]:
    """(ZeRO stage, offload, what was assumed) of a row's data-parallel column: a stage it states, else its
    stack's default (STACK_DEFAULT_OPTIMIZER, said in the third item), else 0."""
    text = data_parallel.lower()
    offload = "cpu" if "offload" in text and "capability" not in text else "none"
    if "shard_grad_op" in text:
        return 2, offload, ""
    if any(word in text for word in ("full_shard", "fsdp", "zero-3", "hsdp", "zero-powered")):
        return 3, offload, ""
    if "distributed optimizer" in text and "not stated" not in text:
        return 1, offload, ""
    if stack in STACK_DEFAULT_OPTIMIZER:
        return (*STACK_DEFAULT_OPTIMIZER[stack][:1], offload, STACK_DEFAULT_OPTIMIZER[stack][1])
    return 0, offload, ""


def _int(value: str) -> int | None:
    return int(float(value)) if value.strip() else None


def family_spec(row: dict) -> str:
    heads, kv = int(row["heads"]), _int(row.get("kv_heads", "")) or int(row["heads"])
    hidden = int(row["hidden"])
    ffn = _int(row.get("ffn", "")) or 4 * hidden
    vocab = _int(row.get("vocab", "")) or 51200  # GPT-3 / Nemotron rows print none: GPT-3's (padded) vocabulary
    llama = kv != heads or "llama" in row["model"].lower() or ffn != 4 * hidden
    family = "llama" if llama else "gpt"
    spec = f"{family}:layers={row['layers']},hidden={hidden},heads={heads},seq={row['seq_len']},vocab={vocab},ffn={ffn}"
    return spec + (f",kv_heads={kv}" if family == "llama" else "")


def measured_seconds(row: dict, gpus: int, batch: int) -> float | None:
    """Iteration time from what the row prints (module docstring); None when it prints no time basis."""
    s, L, h = int(row["seq_len"]), int(row["layers"]), int(row["hidden"])
    V = _int(row.get("vocab", "")) or 51200
    if row.get("iter_time_s", "").strip():
        return float(row["iter_time_s"])
    if row.get("tokens_per_s_per_gpu", "").strip():
        return batch * s / (float(row["tokens_per_s_per_gpu"]) * gpus)
    if not row.get("tflops_per_gpu", "").strip():
        return None
    if row["source"] == "DeepSpeed" or "Narayanan" in row.get("citation", row["source"]):
        flops = 96 * batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))  # Narayanan SC'21 Eq. 3
    elif row["source"] == "NVIDIA/Megatron-LM":
        flops = 72 * batch * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))  # model FLOPs
    elif "NeMo" in row["source"] and row.get("kv_heads", "").strip():  # NeMo's Llama model FLOPs
        # nemo/utils/flops_formulas.py llama2 / llama3: B s L h^2 (12 + 12 G/A + 18 F/h + 12 s/h + 6 V/(L h))
        groups, heads, ffn = int(row["kv_heads"]), int(row["heads"]), int(row["ffn"])
        flops = batch * s * L * h * h * (12 + 12 * groups / heads + 18 * ffn / h + 12 * s / h + 6 * V / (L * h))
    else:
        return None
    return flops / (float(row["tflops_per_gpu"]) * 1e12 * gpus)


def cluster_of(gpu_type: str) -> str | None:
    return next((name for pattern, name in GPU_CLUSTERS if re.search(pattern, gpu_type)), None)


# What a row whose table prints no precision column is priced with, where its footnote names the format:
# Megatron-Bridge's 25.09 summary has no precision column and says its parenthesised variants differ only in FP8
# quantization granularity (its TFLOP/s per GPU equal the next release's FP8 rows of the same layouts: Llama 3 8B
# on H100 725 vs 744, on B200 1544 vs 1519).
FOOTNOTE_FP8 = "different fp8 quantization granularity"


def printed_precision(row: dict) -> tuple[str, str]:
    """(precision, what was assumed): the row's precision column, else fp8 where its notes carry FOOTNOTE_FP8."""
    precision = row["precision"].strip().lower()
    if not precision and FOOTNOTE_FP8 in row["notes"].lower():
        return "fp8", "precision not printed: priced as fp8 (the table's footnote: its variants are FP8 granularities)"
    return precision, ""


def training_run(row: dict, label: str) -> ReferenceRun | str:
    """The row as a ReferenceRun, or the reason zplan cannot express it."""
    cluster = cluster_of(row["gpu_type"])
    precision, precision_assumed = printed_precision(row)
    if cluster is None:
        return f"no built-in profile for {row['gpu_type']}"
    nvfp4 = precision == "nvfp4"  # NVIDIA's NVFP4 recipe (Transformer Engine): the block GEMMs in NVFP4
    if "fp4" in precision and not nvfp4:
        return f"precision {row['precision']} (of the fp4 formats only NVFP4 is priced)"
    fp8 = "fp8" in precision  # FP8 delayed/current scaling (Transformer Engine), MXFP8 (Blackwell): fp8 GEMMs
    mixed = any(p and p in precision for p in PRICED_PRECISIONS[:3]) or precision in PRICED_PRECISIONS
    if not (fp8 or nvfp4 or mixed):
        return f"precision {row['precision']}"
    if "lora" in row["model"].lower():
        return "LoRA fine-tuning (not pre-training)"
    if not all(row[key].strip() for key in ("layers", "hidden", "heads", "seq_len")):
        return "model shape not printed"
    gpus = int(row["gpus"])
    tp, pp, batch = _int(row["tp"]), _int(row["pp"]), _int(row["global_batch"])
    cp = _int(row.get("cp", "")) or 1
    if tp is None or pp is None or batch is None:
        return "layout or global batch not printed"
    if gpus % (tp * pp * cp) or batch % (gpus // (tp * pp * cp)):
        return "layout inconsistent with the GPU count or batch"
    measured = measured_seconds(row, gpus, batch)
    if measured is None:
        return "no measured time basis"
    stack = stack_of(row["source"], row["zero_or_fsdp"])
    zero, offload, assumed = zero_stage(row["zero_or_fsdp"], stack)
    recompute = row["recompute"].lower()
    mode = "full" if recompute.startswith("full") else "selective" if "selective" in recompute else "none"
    micro = _int(row["micro_batch"])
    dp = gpus // (tp * pp * cp)
    virtual = re.search(r"\bVP=([1-9]\d*)", row["notes"])  # NeMo's virtual pipeline size: model chunks per stage
    pins = Pins(tp=tp, pp=pp, dp=dp, cp=cp, zero=zero if dp > 1 else 0, offload=offload, micro_batch=micro,
                recompute=mode, sequence_parallel=False if tp == 1 else None,
                interleave=int(virtual.group(1)) if virtual and pp > 1 else None)
    dtype = "fp16" if cluster == "dgx2-v100" else "fp8" if fp8 else "nvfp4" if nvfp4 else "bf16"
    return ReferenceRun(label, row["source"], stack, family_spec(row), cluster, gpus, batch, dtype, pins, measured,
                        assumed="; ".join(filter(None, (assumed if dp > 1 else "", precision_assumed))),
                        recompute_printed=bool(recompute.strip()))


def published_run(row: dict, label: str) -> ReferenceRun:
    """published_runs.csv (Megatron 2021-22 on Selene): Eq. 3 or the measured time; blank recompute is full."""
    recompute = row["recompute"] or "full"
    gpus, batch = int(row["gpus"]), int(row["global_batch"])
    pins = Pins(tp=int(row["tp"]), pp=int(row["pp"]), dp=int(row["dp"]), zero=0,
                micro_batch=_int(row["micro_batch"]), recompute="full" if recompute == "full" else "selective",
                sequence_parallel="sequence" in recompute, interleave=_int(row["interleave_v"]) or 1, offload="none")
    measured = float(row["iter_time_s"]) if row["iter_time_s"] else measured_seconds(
        {**row, "source": "DeepSpeed"}, gpus, batch)  # Eq. 3, as the paper counts
    # Megatron-LM in 2021-22 ran attention unfused (a fused softmax over materialised (s, s) scores) and dropout.
    spec = "gpt:layers={layers},hidden={hidden},heads={heads},seq={seq_len},vocab={vocab},unfused_attention=1".format(
        **row)
    return ReferenceRun(label, row["source"], "megatron-2021", spec, "dgx-a100-80g", gpus, batch, "bf16", pins,
                        measured)


def load_reference_runs(reference_dir: Path) -> tuple[list[ReferenceRun], dict[str, str]]:
    runs, refused = [], {}
    for index, row in enumerate(csv.DictReader((reference_dir / "published_runs.csv").open())):
        runs.append(published_run(row, f"published#{index}: {row['model']}, {row['gpus']} GPUs"))
    for index, row in enumerate(csv.DictReader((reference_dir / "training_runs.csv").open())):
        label = f"training#{index}: {row['source']}: {row['model']}, {row['gpus']} GPUs"
        run = training_run(row, label)
        if isinstance(run, str):
            refused[label] = run
        else:
            runs.append(run)
    return runs, refused


# --- moe_runs.csv ------------------------------------------------------------------------------------------------

MOE_MODELS = Path(__file__).resolve().parent / "moe_models"
MOE_ARCHITECTURES = [  # (pattern in the model column, architecture file under moe_models/)
    (r"deepseek|kimi", "deepseek_v3.py"),
    (r"qwen3", "qwen3_moe.py"),
    (r"gpt-oss", "gpt_oss.py"),
]
# The attention column's sizes, as build_model's keywords: DeepSeek's MLA ranks, a GQA head_dim, a sliding window.
ATTENTION_SIZES = [(r"\bq_lora (\d+)", "q_lora_rank"), (r"\bkv_lora (\d+)", "kv_lora_rank"),
                   (r"\bqk_nope (\d+)", "qk_nope_head_dim"), (r"\bqk_rope (\d+)", "qk_rope_head_dim"),
                   (r"\bv (\d+)", "v_head_dim"), (r"\bhead_dim (\d+)", "head_dim"),
                   (r"sliding window (\d+)", "sliding_window")]
# Kimi K2's public config.json beside DeepSeek-V3's: no group-limited routing (n_group 1), the rest as the row prints
KIMI_ROUTING = {"n_group": 1, "topk_group": 1}


def moe_architecture(model: str) -> Path | None:
    return next((MOE_MODELS / name for pattern, name in MOE_ARCHITECTURES if re.search(pattern, model.lower())),
                None)


def moe_sizes(row: dict) -> dict:
    """build_model's keywords for the row: its printed dimensions, and the attention column's sizes."""
    sizes = {key: int(row[key]) for key in ("layers", "dense_layers", "hidden", "heads", "kv_heads", "routed_experts",
                                            "shared_experts", "top_k", "expert_ffn", "vocab")}
    if row.get("dense_ffn", "").strip():
        sizes["dense_ffn"] = int(row["dense_ffn"])
    for pattern, key in ATTENTION_SIZES:
        found = re.search(pattern, row.get("attention", ""))
        if found:
            sizes[key] = int(found.group(1))
    if "kimi" in row["model"].lower():
        sizes.update(KIMI_ROUTING)
    return sizes


MODEL_FILE = '''"""Generated by benchmarks/reference_runs.py for {label}: {architecture} at the row's sizes."""
import importlib.util

_spec = importlib.util.spec_from_file_location("zplan_moe_architecture_{stem}", {path!r})
_architecture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_architecture)

SEQ_LEN = {seq_len}
SIZES = {sizes!r}


def build_model(**overrides):
    return _architecture.build_model(**{{**SIZES, **overrides}})
'''


def write_moe_model_file(row: dict, label: str, architecture: Path, path: Path) -> Path:
    path.write_text(MODEL_FILE.format(label=label.replace('"', "'"), architecture=f"moe_models/{architecture.name}",
                                      stem=architecture.stem, path=str(architecture), seq_len=int(row["seq_len"]),
                                      sizes=moe_sizes(row)))
    return path


def moe_precision(precision: str) -> str | None:
    """bf16 -> bf16; any fp8 (DeepSeek's blockwise, current scaling, MXFP8) -> fp8; else None (not priced)."""
    text = precision.lower()
    return "fp8" if "fp8" in text else "bf16" if text.strip() == "bf16" else None


def moe_run(row: dict, label: str, model_dir: Path, index: int) -> ReferenceRun | str:
    """A moe_runs.csv row as a ReferenceRun (its model file written into model_dir), or the reason zplan cannot
    express it (module docstring)."""
    cluster = cluster_of(row["gpu_type"])
    if cluster is None:
        return f"no built-in profile for {row['gpu_type']}"
    precision = moe_precision(row["precision"])
    if precision is None:
        return f"precision {row['precision']}"
    architecture = moe_architecture(row["model"])
    if architecture is None:
        return f"no architecture file under benchmarks/moe_models for {row['model']}"
    gpus, tp, pp = int(row["gpus"]), int(row["tp"]), int(row["pp"])
    cp, ep, batch = _int(row.get("cp", "")) or 1, _int(row.get("ep", "")) or 1, int(row["global_batch"])
    experts = int(row["routed_experts"])
    if gpus % (tp * pp * cp):
        return "layout inconsistent with the GPU count"
    dp = gpus // (tp * pp * cp)
    if dp % ep:
        return (f"ep {ep} does not divide dp {dp} (= gpus / (tp pp cp)): Megatron's MoE parallel folding lets ep "
                f"span tensor-parallel ranks (ep x etp over dp x tp), which zplan does not plan")
    if experts % ep:
        return f"ep {ep} does not divide the {experts} routed experts"
    if batch % dp:
        return "global batch does not divide by dp"
    if not row.get("tokens_per_s_per_gpu", "").strip():
        return "no measured time basis"
    if re.search(r"\bwith MTP\b", row["model"]):
        return "its multi-token prediction layers (MTP), which zplan does not price"
    measured = batch * int(row["seq_len"]) / (float(row["tokens_per_s_per_gpu"]) * gpus)
    fsdp = _int(row.get("fsdp", "")) or 0
    zero, offload, _ = zero_stage("Megatron-FSDP" if fsdp else "Megatron distributed optimizer")
    vp = _int(row.get("vp", "")) or 1
    pins = Pins(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero=zero if dp > 1 else 0, offload=offload,
                micro_batch=_int(row["micro_batch"]), recompute="none",
                sequence_parallel=False if tp == 1 else None, interleave=vp if pp > 1 else None)
    caveat = ("optimizer Muon, priced as AdamW (zplan prices AdamW only)"
              if "muon" in (row["model"] + row.get("notes", "")).lower() else "")
    model_file = write_moe_model_file(row, label, architecture, model_dir / f"moe_row_{index}.py")
    return ReferenceRun(label, row["source"], stack_of(row["source"], ""), str(model_file), cluster, gpus, batch,
                        precision, pins, measured, kind="moe",
                        published_params_b=(float(row["total_params_b"]), float(row["active_params_b"])),
                        caveat=caveat, published_flops_per_token=float(row["tflops_per_gpu"]) * 1e12 / float(
                            row["tokens_per_s_per_gpu"]) if row.get("tflops_per_gpu", "").strip() else None,
                        recompute_printed=False, **recipe_fields(row))


# What each MoE row's performance recipe runs that its table does not print, read from NVIDIA-NeMo/Megatron-Bridge at
# the tag of its container (25.11: v0.2.1, 26.02: v0.3.0, 26.02.01: v0.3.1, 26.04: v0.4.0, 26.04.01: v0.4.2, 26.06:
# v0.5.0, 26.06.01: v0.5.1, 26.08: v0.6.0; docs/releases/software-versions.md, docs/versions1.json), one line a row in
# benchmarks/moe_recipes.csv: the recipe (file and config), whether its layout is the row's, whether it overlaps the
# expert-parallel all-to-all with compute (Megatron-Core's overlap_moe_expert_parallel_comm with delay_wgrad_compute,
# set by moe_a2a_overlap: one micro-batch's dispatch and combine run behind another's forward or backward), and its
# token dispatcher: Megatron-Core's plain all-to-all, or the flex dispatcher with HybridEP or DeepEP, which sends a
# token once to each other node that hosts any of its experts and forwards it there over NVLink (HybridEP's own
# benchmark counts its RDMA bytes so: deepseek-ai/DeepEP, branch hybrid-ep, tests/utils.py
# count_rdma_send_from_routing_map; inside one NVLink domain both dispatches are priced alike). A row whose recipe at
# its tag runs another layout (its table printed an older configuration's), or that the file does not list (the 25.11
# rows: their layouts are not v0.2.1's presets), is priced with neither.
MOE_RECIPES = Path(__file__).resolve().parent / "moe_recipes.csv"
PER_NODE_DISPATCHERS = ("hybridep", "deepep")


RECIPE_KEY = ("source", "model", "gpu_type", "precision", "gpus")  # the columns that name a run in moe_recipes.csv


def _columns(row: dict, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(row.get(name, "").strip() for name in names)


@functools.cache
def moe_recipes(path: Path = MOE_RECIPES) -> dict[tuple, dict]:
    """{(source, model, gpu_type, precision, gpus): the recipe's line} for the lines whose layout is the row's."""
    return {_columns(line, RECIPE_KEY): line for line in csv.DictReader(path.open()) if line["layout_matches"] == "yes"}


def recipe_fields(row: dict) -> dict:
    """ReferenceRun fields for what a row's recipe runs beyond its stack (moe_recipes): the expert-parallel all-to-all
    overlapped with compute (the part hidden) and the tokens dispatched per node, with what the row is priced with; {}
    for the others."""
    recipe = moe_recipes().get(_columns(row, RECIPE_KEY))
    if recipe is None:
        return {}
    fields, assumed, source = {}, [], f"{recipe['tag']} {recipe['recipe']}"
    if recipe["a2a_overlap"] == "yes":
        fields["recipe_hides"] = ("expert_parallel",)
        assumed.append(f"expert-parallel all-to-all overlapped with compute, as its recipe runs it ({source})")
    if recipe["dispatcher"] in PER_NODE_DISPATCHERS:
        fields["dispatch"] = "per_node"
        assumed.append(f"tokens dispatched per node ({recipe['dispatcher']}), as its recipe runs them ({source})")
    return {**fields, "assumed": "; ".join(assumed)} if assumed else {}


_MODEL_DIR: Path | None = None


def _moe_model_dir() -> Path:
    """A temporary folder for the rows' model files, removed at exit."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        _MODEL_DIR = Path(tempfile.mkdtemp(prefix="zplan-moe-rows-"))
        atexit.register(shutil.rmtree, _MODEL_DIR, True)
    return _MODEL_DIR


def moe_label(index: int, row: dict) -> str:
    return f"moe#{index}: {row['source']}: {row['model']}, {row['gpus']} {row['gpu_type']}, {row['precision']}"


# Rows added from the same tables, as the reference folder's README asks: every other mixture-of-experts row of
# Megatron-Bridge's pre-training tables from 25.11 to 26.08 (docs/performance-summary-archive.md and
# docs/performance-summary.md: DGX-GB300, DGX-GB200, DGX-B300, DGX-B200, DGX-H100), transcribed with the columns of
# moe_runs.csv and the model dimensions of its rows of the same models. A row moe_runs.csv itself holds is read from
# there only.
ADDED_MOE_RUNS = Path(__file__).resolve().parent / "moe_runs_added.csv"


ROW_KEY = (*RECIPE_KEY, "tokens_per_s_per_gpu")  # the columns that name a published row


def load_moe_runs(reference_dir: Path, model_dir: Path | None = None,
                  added: Path | None = ADDED_MOE_RUNS) -> tuple[list[ReferenceRun], dict[str, str]]:
    """moe_runs.csv, then the rows `added` (default ADDED_MOE_RUNS; None: none), as ReferenceRuns (kind "moe"; their
    model files written into model_dir, default a temporary folder) and {row label: reason} for the rows zplan cannot
    express."""
    runs, refused = [], {}
    path = reference_dir / "moe_runs.csv"
    if not path.is_file():
        return runs, refused
    folder = model_dir or _moe_model_dir()
    rows = list(csv.DictReader(path.open()))
    if added is not None:
        published = {_columns(row, ROW_KEY) for row in rows}
        rows += [row for row in csv.DictReader(added.open()) if _columns(row, ROW_KEY) not in published]
    for index, row in enumerate(rows):
        label = moe_label(index, row)
        run = moe_run(row, label, folder, index)
        if isinstance(run, str):
            refused[label] = run
        else:
            runs.append(run)
    return runs, refused
