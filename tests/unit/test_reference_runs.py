"""benchmarks/reference_runs.py and the validation's stack efficiencies: rows of the published-runs files as zplan
requests, their measured times from what each row prints, and the leave-one-source-out fit, by hand."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from reference_runs import measured_seconds, training_run, zero_stage  # noqa: E402
from validate_cost_model import mean, relative_error, stack_efficiencies  # noqa: E402

from zplan.planner.family import parse_family_spec  # noqa: E402

ROW = dict(source="mosaicml/llm-foundry", citation="", model="MPT-7b", params_b="6.7", layers="32", hidden="4096",
           heads="32", kv_heads="32", ffn="16384", seq_len="2048", vocab="50368", gpus="8", gpu_type="H100 80GB",
           tp="1", pp="1", cp="1", dp="8", zero_or_fsdp="FSDP1 FULL_SHARD", micro_batch="6", global_batch="48",
           recompute="none", precision="amp_bf16 (MP DEFAULT)", tokens_per_s_per_gpu="4000", tflops_per_gpu="",
           mfu="", hfu="", iter_time_s="", memory_gib="", notes="")


def test_a_row_becomes_the_request_it_prints():
    run = training_run(ROW, "row")
    assert (run.cluster, run.gpus, run.global_batch, run.precision, run.stack) == ("dgx-h100", 8, 48, "bf16", "fsdp1")
    p = run.pins
    assert (p.tp, p.pp, p.dp, p.zero, p.micro_batch, p.recompute) == (1, 1, 8, 3, 6, "none")
    assert run.measured_s == pytest.approx(48 * 2048 / (4000 * 8))  # tokens a step / tokens per second
    spec = parse_family_spec(run.spec)
    assert (spec.family, spec.layers, spec.hidden, spec.ffn, spec.vocab) == ("gpt", 32, 4096, 16384, 50368)


def test_a_llama_row_keeps_its_grouped_heads_and_width():
    run = training_run({**ROW, "model": "Llama 3 8B", "kv_heads": "8", "ffn": "14336", "vocab": "128256"}, "row")
    spec = parse_family_spec(run.spec)
    assert (spec.family, spec.kv_heads, spec.ffn) == ("llama", 8, 14336)


def test_fp8_and_nvl72_rows_map_to_fp8_on_the_rack_profile():
    for precision in ("FP8", "MXFP8", "FP8 current scaling", "amp_fp8 (MP DEFAULT)"):
        run = training_run({**ROW, "precision": precision, "gpu_type": "GB200 (NVL72)"}, "row")
        assert (run.precision, run.cluster) == ("fp8", "gb200-nvl72")


def test_nvfp4_rows_map_to_nvfp4_and_other_fp4_formats_are_refused():
    run = training_run({**ROW, "precision": "NVFP4", "gpu_type": "GB300 (NVL72)"}, "row")
    assert (run.precision, run.cluster) == ("nvfp4", "gb300-nvl72")
    assert "only NVFP4" in training_run({**ROW, "precision": "MXFP4", "gpu_type": "GB300 (NVL72)"}, "row")


def test_a_row_without_precision_takes_the_one_its_tables_footnote_names():
    footnoted = training_run({**ROW, "precision": "", "notes": "25.09 table has no precision column (parenthesised "
                              "values = different FP8 quantization granularity)"}, "row")
    assert footnoted.precision == "fp8" and "precision not printed" in footnoted.assumed
    silent = training_run({**ROW, "precision": "", "notes": "precision not printed"}, "row")
    assert (silent.precision, silent.assumed) == ("bf16", "")  # nothing named: mixed 16-bit, as before


@pytest.mark.parametrize("update, reason", [
    (dict(precision="MXFP4"), "fp4"), (dict(gpu_type="MI300X"), "no built-in profile"),
    (dict(cp="3"), "inconsistent"), (dict(global_batch=""), "not printed"),
    (dict(tokens_per_s_per_gpu=""), "no measured time"), (dict(model="Llama 3 8B (LoRA)"), "LoRA"),
])
def test_rows_zplan_cannot_express_say_why(update, reason):
    assert reason in training_run({**ROW, **update}, "row")


def test_context_parallel_is_pinned_and_dp_is_what_is_left():
    run = training_run({**ROW, "cp": "2", "global_batch": "8"}, "row")
    assert (run.pins.cp, run.pins.dp, run.pins.tp, run.pins.pp) == (2, 4, 1, 1)


def test_nemo_rows_that_print_only_tflops_use_nemos_llama_formula():
    """nemo/utils/flops_formulas.py llama2/llama3 by hand: B s L h^2 (12 + 12 G/A + 18 F/h + 12 s/h + 6 V/(L h))."""
    row = {**ROW, "source": "NVIDIA NeMo (Megatron-Core)", "kv_heads": "8", "ffn": "14336", "vocab": "128256",
           "seq_len": "32768", "tokens_per_s_per_gpu": "", "tflops_per_gpu": "1000"}
    B, s, L, h = 16, 32768, 32, 4096
    flops = B * s * L * h * h * (12 + 12 * 8 / 32 + 18 * 14336 / h + 12 * s / h + 6 * 128256 / (L * h))
    assert measured_seconds(row, 8, B) == pytest.approx(flops / (1000e12 * 8))


def test_time_from_tflops_uses_the_formula_the_source_names():
    row = {**ROW, "source": "NVIDIA/Megatron-LM", "tokens_per_s_per_gpu": "", "tflops_per_gpu": "400"}
    B, s, L, h, V = 48, 2048, 32, 4096, 50368
    model_flops = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))  # Korthikanti et al.
    assert measured_seconds(row, 8, B) == pytest.approx(model_flops / (400e12 * 8))
    deepspeed = {**row, "source": "DeepSpeed"}
    eq3 = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))  # Narayanan et al. Eq. 3
    assert measured_seconds(deepspeed, 8, B) == pytest.approx(eq3 / (400e12 * 8))


@pytest.mark.parametrize("text, stage", [("FSDP1 FULL_SHARD", (3, "none")), ("FSDP1 SHARD_GRAD_OP", (2, "none")),
                                         ("Megatron DDP", (0, "none")), ("ZeRO-3 Offload", (3, "cpu"))])
def test_data_parallel_column_to_zero_stage(text, stage):
    assert zero_stage(text) == (*stage, "")


@pytest.mark.parametrize("text", ["Megatron DDP", "Megatron DDP (distributed optimizer not stated)", ""])
def test_megatron_core_rows_that_do_not_state_the_optimizer_sharding_are_priced_with_its_default(text):
    stage, offload, assumed = zero_stage(text, "megatron-core")
    assert (stage, offload) == (1, "none") and "distributed optimizer" in assumed
    assert zero_stage("Megatron-FSDP", "megatron-core") == (3, "none", "")  # stated: nothing assumed
    assert zero_stage(text, "megatron-2021")[::2] == (0, "")  # a stack without the default keeps ZeRO 0


def test_stack_efficiency_is_the_geometric_mean_and_applies_per_stack():
    rows = [dict(stack="fsdp1", measured_s=2.0, predicted_s=1.0, attention_s=0.5),
            dict(stack="fsdp2", measured_s=8.0, predicted_s=1.0, attention_s=0.5),
            dict(stack="megatron-core", measured_s=1.0, predicted_s=1.0, attention_s=0.0)]
    efficiencies = stack_efficiencies(rows)  # too few rows to fit an attention factor: 1
    # FSDP1 and FSDP2 share one efficiency (STACK_GROUPS: the same eager kernels)
    assert efficiencies == {"pytorch-fsdp": (pytest.approx(math.sqrt(2.0 * 8.0)), 1.0), "megatron-core": (1.0, 1.0)}
    assert relative_error(rows[0], efficiencies) == pytest.approx(4.0 / 2.0 - 1.0)
    assert relative_error(rows[1], efficiencies) == pytest.approx(4.0 / 8.0 - 1.0)
    assert relative_error(rows[0], {}) == pytest.approx(-0.5)  # a stack fitted nowhere keeps efficiency 1


def test_a_stack_with_a_faster_attention_kernel_is_fitted_its_factor():
    """Twelve rows whose attention share varies, measured as if the stack's attention ran 2x the profile's and the
    rest 1.1x slower: the fit recovers both (by hand: 1.1 * (p - a + a / 2))."""
    rows = [dict(stack="megatron-core", predicted_s=1.0, attention_s=a, measured_s=1.1 * (1.0 - a + a / 2.0))
            for a in [0.05 * i for i in range(1, 13)]]
    efficiency, factor = stack_efficiencies(rows)["megatron-core"]
    assert (efficiency, factor) == (pytest.approx(1.1), 2.0)
    assert max(abs(relative_error(r, {"megatron-core": (efficiency, factor)})) for r in rows) < 1e-9


def test_an_attention_factor_the_rows_hardly_support_is_not_kept():
    """Twelve rows of a stack whose attention runs 1.2x the profile's, each off by a factor exp(+-0.15) in turn: the
    mean |log error| keeps falling to the grid's end (2.0), but by less than its standard error there, so the
    one-standard-error rule keeps no correction (factor 1); by hand below."""
    rows = [dict(stack="megatron-core", predicted_s=1.0, attention_s=a,
                 measured_s=1.1 * (1.0 - a + a / 1.2) * math.exp(0.15 * (-1) ** i))
            for i, a in enumerate([0.05 * i for i in range(1, 13)])]

    def spread(f):  # mean |log error| about its centre at factor f, and that mean's standard error
        logs = [math.log(r["measured_s"] / (1.0 - r["attention_s"] + r["attention_s"] / f)) for r in rows]
        deviations = [abs(v - mean(logs)) for v in logs]
        return mean(deviations), math.sqrt(mean((d - mean(deviations)) ** 2 for d in deviations) / len(rows))

    (least, standard_error), best = min((spread(f), f) for f in (0.5, 1.0, 1.2, 1.5, 2.0))
    assert best == 2.0 and least < spread(1.0)[0] <= least + standard_error
    efficiency, factor = stack_efficiencies(rows)["megatron-core"]
    assert factor == 1.0 and efficiency == pytest.approx(math.exp(mean(math.log(r["measured_s"]) for r in rows)))


REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference"


@pytest.mark.skipif(not (REFERENCE / "training_runs.csv").is_file(), reason="../shared/reference is not beside")
def test_the_published_runs_are_predicted_out_of_sample_within_a_fifth():
    """The whole validation (about 5 s): every expressible row is predicted, and leaving each source out of the
    stack efficiencies' fit, the mean error stays under 20 % (14.1 % on 2026-12-02; the issue's target is 15 %)."""
    from validate_cost_model import validate

    result = validate(REFERENCE, moe=False)  # the MoE rows: tests/unit/test_moe_reference_runs.py
    assert not [reason for reason in result["refused"].values() if reason.startswith("zplan refuses")]
    assert result["coverage"] >= 0.7 and result["loso_mean_abs_error"] < 0.2


@pytest.mark.parametrize("notes, interleave", [("TP=1; VP=4; MBS=1", 4), ("VP=n/a", None), ("VP=0", None),
                                               ("VP=3", 3)])
def test_the_virtual_pipeline_in_the_notes_is_the_interleave(notes, interleave):
    """NeMo prints VP=N in the notes: 32 blocks in pp 2 x VP 4 chunks split evenly; VP=3 does not (the embedding
    and head then count as a block each: planner.search.interleaved_partition); n/a or 0 pin nothing."""
    run = training_run({**ROW, "pp": "2", "dp": "4", "notes": notes}, "row")
    assert run.pins.interleave == interleave
