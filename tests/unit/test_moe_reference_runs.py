"""benchmarks/reference_runs.py's MoE rows (../shared/reference/moe_runs.csv, benchmarks/moe_runs_added.csv): each
row as the request it prints (layout, ep, batches, precision, measured seconds), the refused ones with their reason,
what each row's recipe runs (benchmarks/moe_recipes.csv), and one row's model file traced to its printed parameter
counts. Only the DeepSeek-V3 row is traced (about 3-8 s)."""

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from reference_runs import load_moe_runs, moe_run, moe_sizes  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference"

ROW = dict(source="NVIDIA Megatron-Bridge 26.08", citation="", model="DeepSeek-V3", total_params_b="671",
           active_params_b="37", layers="61", dense_layers="3", hidden="7168", heads="128", kv_heads="128",
           attention="MLA (q_lora 1536; kv_lora 512; qk_nope 128; qk_rope 64; v 128)", dense_ffn="18432",
           routed_experts="256", shared_experts="1", top_k="8", expert_ffn="2048", vocab="129280", seq_len="4096",
           gpus="256", gpu_type="GB200", precision="mxfp8", tp="1", pp="4", vp="4", ep="64", cp="1", fsdp="0",
           micro_batch="1", global_batch="4096", routing="force-balanced dropless", tokens_per_s_per_gpu="4912",
           tflops_per_gpu="1276", notes="")


def test_a_moe_row_becomes_the_request_it_prints(tmp_path):
    run = moe_run(ROW, "row", tmp_path, 0)
    assert (run.kind, run.stack, run.cluster, run.precision, run.gpus, run.global_batch) == (
        "moe", "megatron-core", "gb200-nvl72", "fp8", 256, 4096)
    p = run.pins
    assert (p.tp, p.pp, p.dp, p.cp, p.ep, p.interleave, p.zero, p.micro_batch, p.recompute) == (
        1, 4, 64, 1, 64, 4, 1, 1, "none")  # dp = 256 / (1 * 4 * 1); the distributed optimizer: ZeRO-1
    assert run.measured_s == pytest.approx(4096 * 4096 / (4912 * 256))
    assert run.published_params_b == (671.0, 37.0)
    assert Path(run.spec).parent == tmp_path and "SIZES" in Path(run.spec).read_text()


def test_sizes_come_from_the_columns_and_the_attention_column():
    sizes = moe_sizes(ROW)
    assert (sizes["routed_experts"], sizes["dense_layers"], sizes["q_lora_rank"], sizes["kv_lora_rank"],
            sizes["qk_rope_head_dim"], sizes["v_head_dim"]) == (256, 3, 1536, 512, 64, 128)
    qwen = moe_sizes({**ROW, "model": "Qwen3-30B-A3B", "attention": "GQA head_dim 128", "dense_ffn": ""})
    assert qwen["head_dim"] == 128 and "dense_ffn" not in qwen and "q_lora_rank" not in qwen
    kimi = moe_sizes({**ROW, "model": "Kimi K2 (Muon optimizer)", "routed_experts": "384", "attention": "MLA"})
    assert (kimi["routed_experts"], kimi["n_group"]) == (384, 1)


@pytest.mark.parametrize("update, reason", [
    (dict(tp="2", pp="8", ep="32"), "MoE parallel folding"),  # dp 16: ep 32 spans tensor-parallel ranks
    (dict(ep="32", routed_experts="48"), "routed experts"), (dict(gpu_type="MI300X"), "no built-in profile"),
    (dict(precision="nvfp4"), "precision"), (dict(model="Mixtral"), "no architecture file"),
])
def test_rows_zplan_cannot_express_say_why(tmp_path, update, reason):
    assert reason in moe_run({**ROW, **update}, "row", tmp_path, 0)


def test_muon_is_kept_with_its_caveat(tmp_path):
    run = moe_run({**ROW, "model": "Kimi K2 (Muon optimizer)"}, "row", tmp_path, 0)
    assert "Muon" in run.caveat and "AdamW" in run.caveat


@pytest.mark.skipif(not (REFERENCE / "moe_runs.csv").is_file(), reason="../shared/reference is not beside")
def test_the_published_moe_rows_load_with_their_layouts(tmp_path):
    """Every row but Qwen3-235B on H100 (ep 32 over dp 16) is expressed, with the layout it prints."""
    runs, refused = load_moe_runs(REFERENCE, tmp_path, added=None)
    assert len(runs) == 9 and list(refused) == [
        "moe#6: NVIDIA Megatron-Bridge 26.04.01: Qwen3-235B-A22B, 256 H100-SXM-80GB, fp8"]
    layouts = {run.label.split(":")[0]: (run.pins.tp, run.pins.pp, run.pins.dp, run.pins.ep, run.pins.interleave,
                                         run.pins.micro_batch, run.global_batch, run.precision) for run in runs}
    assert layouts == {
        "moe#0": (2, 8, 64, 64, 4, 1, 8192, "fp8"), "moe#1": (1, 4, 64, 64, 4, 1, 4096, "bf16"),
        "moe#2": (1, 4, 64, 64, 4, 1, 4096, "fp8"), "moe#3": (1, 2, 128, 32, 8, 1, 4096, "fp8"),
        "moe#4": (1, 1, 16, 16, None, 1, 1024, "fp8"), "moe#5": (1, 2, 8, 8, 24, 2, 512, "fp8"),
        "moe#7": (1, 8, 32, 32, 3, 1, 8192, "fp8"), "moe#8": (1, 4, 16, 8, 1, 1, 1280, "bf16"),
        "moe#9": (1, 4, 64, 64, 4, 2, 4096, "fp8")}
    assert {run.stack for run in runs} == {"megatron-core"}
    assert [run.label.split(":")[0] for run in runs if run.caveat] == ["moe#9"]  # Kimi K2's Muon


def test_the_deepseek_row_traces_to_its_printed_parameters(tmp_path):
    """The row's model file built on meta: 671B parameters of which 37B active (within 2 %)."""
    pytest.importorskip("transformers")
    from zplan.model_input import summarize_model

    run = moe_run(ROW, "row", tmp_path, 0)
    summary = summarize_model(run.spec, None, "bf16")[1]
    assert summary.seq_len == 4096
    assert summary.params / 1e9 == pytest.approx(671, rel=0.02)
    assert summary.experts.active_params / 1e9 == pytest.approx(37, rel=0.02)
    assert (summary.experts.num_experts, summary.experts.top_k, summary.experts.moe_blocks) == (256, 8, 58)


def test_megatron_core_fp8_rows_price_their_experts_at_the_gemm_peak_and_no_other_row_does(tmp_path):
    """validate_cost_model.experts_as_run: Transformer Engine's grouped GEMM runs Megatron-Core's experts inside
    its fp8 autocast, so such a row's ExpertsSummary.at_gemm_peak is set; a bf16 row, another stack or a dense model
    keeps the summary as traced (zplan's runtime converts nn.Linear only)."""
    from dataclasses import replace

    from validate_cost_model import experts_as_run

    from zplan.api import prepare
    from zplan.examples import __file__ as examples_init
    from zplan.schemas.spec import Pins

    moe_file = str(Path(examples_init).parent / "moe.py")
    request = prepare(moe_file, 8, "dgx-h100", 8, 64, "fp8", Pins())
    fp8_run = replace(moe_run(ROW, "row", tmp_path, 0), dispatch="all_to_all")  # the dispatch alone: the next test
    assert request.summary.experts.at_gemm_peak is False
    assert experts_as_run(fp8_run, request).summary.experts.at_gemm_peak is True
    assert experts_as_run(replace(fp8_run, precision="bf16"), request) is request
    assert experts_as_run(replace(fp8_run, stack="fsdp2"), request) is request
    dense = prepare(str(Path(examples_init).parent / "gpt.py"), 8, "dgx-h100", 8, 64, "fp8", Pins())
    assert experts_as_run(fp8_run, dense) is dense


def test_rows_are_priced_with_what_their_recipes_run(tmp_path):
    """reference_runs.recipe_fields (benchmarks/moe_recipes.csv): the 26.08 GB200 DeepSeek-V3 recipe overlaps the
    all-to-all; the 26.06 H100 Qwen3-30B-A3B recipe dispatches per node with HybridEP, which
    experts_as_run carries into the request's ExpertsSummary; a row of neither keeps both defaults."""
    from validate_cost_model import experts_as_run

    from zplan.api import prepare
    from zplan.examples import __file__ as examples_init
    from zplan.schemas.spec import Pins

    overlapped = moe_run(ROW, "row", tmp_path, 0)  # its recipe also runs HybridEP: alike inside one NVL72 rack
    assert (overlapped.recipe_hides, overlapped.dispatch) == (("expert_parallel",), "per_node")
    assert "overlapped" in overlapped.assumed and "hybridep" in overlapped.assumed
    qwen = dict(ROW, source="NVIDIA Megatron-Bridge 26.06", model="Qwen3-30B-A3B", gpu_type="H100-SXM-80GB",
                precision="fp8", pp="1", vp="", ep="16", gpus="16", global_batch="1024")
    per_node = moe_run(qwen, "qwen", tmp_path, 1)
    assert (per_node.recipe_hides, per_node.dispatch) == ((), "per_node")
    assert "hybridep" in per_node.assumed
    plain = moe_run(dict(ROW, source="NVIDIA Megatron-Bridge 25.11", precision="bf16"), "plain", tmp_path, 2)
    assert (plain.recipe_hides, plain.dispatch, plain.assumed) == ((), "all_to_all", "")
    request = prepare(str(Path(examples_init).parent / "moe.py"), 8, "dgx-h100", 8, 64, "bf16", Pins())
    assert experts_as_run(per_node, request).summary.experts.dispatch == "per_node"
    assert experts_as_run(plain, request) is request  # bf16: the experts as traced too


@pytest.mark.skipif(not (REFERENCE / "moe_runs.csv").is_file(), reason="../shared/reference is not beside")
def test_the_added_rows_follow_the_published_ones_with_their_layouts(tmp_path):
    """The rest of the 25.11 tables: numbered after moe_runs.csv's rows, their layouts as printed, the row with MTP
    and the one with ep folded over tp refused with their reasons."""
    shared, _ = load_moe_runs(REFERENCE, tmp_path, added=None)
    runs, refused = load_moe_runs(REFERENCE, tmp_path)
    added = [run for run in runs if run not in shared]
    assert len(added) == 91 and {run.source.split()[-1] for run in added} == {
        "25.11", "26.02", "26.02.01", "26.04", "26.04.01", "26.06", "26.06.01", "26.08"}
    assert [run.label.split(":")[0] for run in runs[:len(shared)]] == [run.label.split(":")[0] for run in shared]
    by_label = {run.label.split(": ", 1)[1]: run for run in added}
    gpt_oss = by_label["NVIDIA Megatron-Bridge 25.11: GPT-OSS-120B, 64 GB300, bf16"]
    assert (gpt_oss.pins.ep, gpt_oss.pins.dp, gpt_oss.pins.micro_batch, gpt_oss.global_batch) == (64, 64, 2, 1280)
    # 1280 sequences of 8192 tokens at 18347 tokens/s on each of 64 GPUs
    assert gpt_oss.measured_s == pytest.approx(1280 * 8192 / (18347 * 64))
    qwen = by_label["NVIDIA Megatron-Bridge 25.11: Qwen3-235B-A22B, 256 GB300, bf16"]
    assert (qwen.pins.pp, qwen.pins.interleave, qwen.pins.ep, qwen.pins.micro_batch) == (4, 12, 16, 2)
    reasons = {label.split(": ", 1)[1]: why for label, why in refused.items()}
    assert "multi-token prediction" in reasons["NVIDIA Megatron-Bridge 25.11: DeepSeek-V3 (with MTP), 256 B200, mxfp8"]
    assert "ep 32 does not divide dp 16" in reasons[
        "NVIDIA Megatron-Bridge 25.11: Qwen3-235B-A22B, 256 H100-SXM-80GB, fp8 current scaling"]


def test_each_recipe_line_says_one_thing_and_a_layout_the_recipe_does_not_run_is_priced_without_it():
    """benchmarks/moe_recipes.csv: values from a closed set, no two lines for one row that disagree; the 26.02.01
    Qwen3-30B-A3B H100 row prints v0.3.0's layout (pp 2, vp 12, ep 8), not v0.3.1's recipe, so its overlap is not
    applied."""
    from reference_runs import MOE_RECIPES, moe_recipes, recipe_fields

    lines = list(csv.DictReader(MOE_RECIPES.open()))
    assert {line["a2a_overlap"] for line in lines} == {"yes", "no"}
    assert {line["layout_matches"] for line in lines} == {"yes", "no"}
    assert {line["dispatcher"] for line in lines} <= {"alltoall", "hybridep", "deepep"}
    said: dict[tuple, tuple] = {}
    for line in lines:
        key = tuple(line[k] for k in ("source", "model", "gpu_type", "precision", "gpus"))
        assert said.setdefault(key, (line["a2a_overlap"], line["dispatcher"])) == (line["a2a_overlap"],
                                                                                   line["dispatcher"]), key
    mismatched = dict(source="NVIDIA Megatron-Bridge 26.02.01", model="Qwen3-30B-A3B", gpu_type="H100-SXM-80GB",
                      precision="fp8", gpus="16")
    assert any(all(line[k] == v for k, v in mismatched.items()) and line["layout_matches"] == "no" for line in lines)
    assert tuple(mismatched.values()) not in moe_recipes()
    assert recipe_fields(mismatched) == {}


def test_an_added_row_that_moe_runs_csv_holds_is_read_once(tmp_path):
    reference = tmp_path / "reference"
    reference.mkdir()
    header = ",".join(ROW)
    line = ",".join(f'"{value}"' for value in ROW.values())
    (reference / "moe_runs.csv").write_text(f"{header}\n{line}\n")
    (tmp_path / "added.csv").write_text(f"{header}\n{line}\n")
    runs, refused = load_moe_runs(reference, tmp_path, added=tmp_path / "added.csv")
    assert len(runs) + len(refused) == 1
