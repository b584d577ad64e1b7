"""The runtime refuses a run its plan was not made for, with one message that names the difference."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.fsdp

from tests.distributed.harness import emit
from tests.plan_samples import runnable_plan
from zplan.errors import PlanMismatchError
from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cpu_local import CPU_LOCAL
from zplan.runtime.launch.distributed import RunContext
from zplan.runtime.plan.apply import warn_if_other_devices
from zplan.runtime.plan.check import check_plan, device_mismatch, load_plan
from zplan.schemas import Plan

MODEL_SOURCE = "import torch\n\ndef build_model():\n    return torch.nn.Linear(4, 4)\n"


def make_plan(model_ref: str, sha256: str, *, world_size: int = 2, zero_stage: int = 0,
              source: str = "file") -> Plan:
    """A minimal data-parallel plan; only the fields the check reads matter."""
    return runnable_plan(model_ref, model_sha256=sha256, units=["blocks.0"], hidden=4, heads=1, vocab=4, seq_len=4,
                         ffn_hidden=4, micro_batch=2, num_micro_batches=1, dp=world_size, zero_stage=zero_stage,
                         source=source, name="m")


@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "model.py"
    path.write_text(MODEL_SOURCE)
    return path


def plan_for(model_file: Path, **kwargs) -> Plan:
    return make_plan(str(model_file), hashlib.sha256(model_file.read_bytes()).hexdigest(), **kwargs)


def test_matching_run_passes(model_file):
    check_plan(plan_for(model_file), model_file, world_size=2)


def test_wrong_world_size_names_both_sizes(model_file):
    with pytest.raises(PlanMismatchError, match=r"world size: this run has 3 process\(es\), the plan was made "
                                                r"for 2; .* --gpus 3"):
        check_plan(plan_for(model_file), model_file, world_size=3)


def test_edited_model_file_asks_to_recompile(model_file):
    plan = plan_for(model_file)
    model_file.write_text(MODEL_SOURCE + "# edited\n")
    with pytest.raises(PlanMismatchError, match="model file edited since the plan was made: recompile"):
        check_plan(plan, model_file, world_size=2)


def test_another_models_file_is_named_as_such(model_file, tmp_path):
    other = tmp_path / "other_model.py"
    other.write_text(MODEL_SOURCE + "# another model\n")
    with pytest.raises(PlanMismatchError, match=rf"made for another model file, {model_file}, not {other}"):
        check_plan(plan_for(model_file), other, world_size=2)


def test_every_difference_is_listed(model_file):
    plan = plan_for(model_file)
    model_file.write_text(MODEL_SOURCE + "# edited\n")
    with pytest.raises(PlanMismatchError) as error:
        check_plan(plan, model_file, world_size=4)
    assert "model file edited" in str(error.value) and "world size" in str(error.value)


def test_family_plan_cannot_run(model_file):
    spec = "gpt:layers=2,hidden=64,heads=4,seq=64,vocab=256"
    plan = make_plan(spec, hashlib.sha256(spec.encode()).hexdigest(), source="family")
    with pytest.raises(PlanMismatchError, match="family specs are for planning only"):
        check_plan(plan, None, world_size=2)


def test_missing_torch_feature_is_named(model_file, monkeypatch):
    monkeypatch.delattr(torch.distributed.fsdp, "fully_shard")
    with pytest.raises(PlanMismatchError, match=r"lacks torch\.distributed\.fsdp\.fully_shard.*ZeRO 3"):
        check_plan(plan_for(model_file, zero_stage=3), model_file, world_size=2)


@pytest.mark.parametrize("zero_stage, offload, runs", [(3, "nvme", True), (1, "nvme", True), (0, "nvme", False),
                                                     (1, "cpu", True), (0, "cpu", False), (2, "cpu", True),
                                                     (3, "cpu", True), (1, "none", True)])
def test_offload_the_runtime_cannot_run_yet_is_refused(zero_stage, offload, runs, model_file):
    plan = plan_for(model_file, zero_stage=zero_stage)
    plan = plan.model_copy(update=dict(parallel=plan.parallel.model_copy(update=dict(offload=offload))))
    if runs:
        check_plan(plan, model_file, world_size=2)
    else:
        with pytest.raises(PlanMismatchError, match=r"the runtime does not run .*offload.*\): pin"):
            check_plan(plan, model_file, world_size=2)


@pytest.mark.parametrize("zero_stage, runs", [(3, True), (2, False)])
def test_parameters_on_nvme_need_zero3(zero_stage, runs, model_file):
    """ZeRO-3's parameter shards swap to NVMe (runtime.offload.param_swap); no other stage shards them."""
    plan = plan_for(model_file, zero_stage=zero_stage)
    plan = plan.model_copy(update=dict(parallel=plan.parallel.model_copy(update=dict(offload="nvme")),
                                       placement=plan.placement.model_copy(update=dict(parameters="nvme"))))
    if runs:
        check_plan(plan, model_file, world_size=2)
    else:
        with pytest.raises(PlanMismatchError, match=r"parameters on NVMe with ZeRO 2 .*: pin --zero 3"):
            check_plan(plan, model_file, world_size=2)


@pytest.mark.parametrize("zero_stage, compress, runs", [
    (1, dict(grad="int8"), True), (3, dict(grad="int8"), False), (0, dict(grad="1bit"), True),
    (1, dict(grad="1bit"), True), (3, dict(grad="1bit"), False), (3, dict(weights="int8"), True),
    (1, dict(weights="int8"), False), (0, dict(activations="int8"), False)])
def test_compression_the_plan_cannot_run_is_refused(zero_stage, compress, runs, model_file):
    """What runtime/compression runs (act=int8 needs pp > 1; this plan has pp = 1)."""
    from zplan.schemas.spec import CompressionConfig

    plan = plan_for(model_file, zero_stage=zero_stage)
    plan = plan.model_copy(update=dict(parallel=plan.parallel.model_copy(
        update=dict(compression=CompressionConfig(**compress)))))
    if runs:
        check_plan(plan, model_file, world_size=2)
    else:
        with pytest.raises(PlanMismatchError, match=r"--compress .* recompile with a --compress that fits"):
            check_plan(plan, model_file, world_size=2)


def test_load_plan_round_trip_and_errors(model_file, tmp_path):
    plan = plan_for(model_file)
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    assert load_plan(tmp_path / "plan.json") == plan
    with pytest.raises(PlanMismatchError, match="cannot read the plan"):
        load_plan(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"schema_version": 1}')
    with pytest.raises(PlanMismatchError, match="not a plan this zplan can read"):
        load_plan(tmp_path / "bad.json")


def _run_emitted_script(plan: Plan, out_dir: Path, model_path: Path | None) -> subprocess.CompletedProcess:
    """train.py for `plan` run as a plain `python train.py` (a process of its own: its exit status and stderr
    are what this checks)."""
    script = emit(plan, model_path, out_dir)
    return subprocess.run([sys.executable, str(script), "--steps", "1"], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_emitted_script_exits_2_with_the_message(model_file, tmp_path):
    """A plan for 2 processes started as one plain process, and a family plan: status 2, no traceback."""
    result = _run_emitted_script(plan_for(model_file), tmp_path / "out", model_file)
    assert result.returncode == 2, result.stderr
    assert "zplan: error: plan does not match this run: world size: this run has 1" in result.stderr
    assert "Traceback" not in result.stderr

    spec = "gpt:layers=2,hidden=64,heads=4,seq=64,vocab=256"
    family = make_plan(spec, hashlib.sha256(spec.encode()).hexdigest(), world_size=1, source="family")
    result = _run_emitted_script(family, tmp_path / "family", None)
    assert result.returncode == 2, result.stderr
    assert "family specs are for planning only" in result.stderr and "Traceback" not in result.stderr


def test_an_invalid_plan_json_names_the_field_and_its_value(model_file, tmp_path):
    import json

    from zplan.runtime.plan.check import load_plan

    data = json.loads(plan_for(model_file).model_dump_json())
    data["parallel"]["micro_batch"] = -3
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanMismatchError, match=r"parallel\.micro_batch = -3: Input should be greater than 0"):
        load_plan(path)


# ---- devices the plan was not made for: one warning, the run goes on --------------------------------------------

A100_80 = BUILTIN_CLUSTERS["dgx-a100-80g"]


@pytest.mark.parametrize("cluster, device_type, name, memory", [
    ("cpu-local", "cpu", "", 0),
    ("dgx-a100-80g", "cuda", "NVIDIA A100-SXM4-80GB", 85_100_000_000),  # 79.3 GiB, as torch reports it
    ("dgx-h200", "cuda", "NVIDIA H200", 150_000_000_000),  # 139.7 GiB
    ("gb200-nvl72", "cuda", "NVIDIA GB200", 197_000_000_000),  # 186 GB + 6 %: its model in the name "GB200"
])
def test_the_plans_own_devices_pass(cluster, device_type, name, memory):
    assert device_mismatch(BUILTIN_CLUSTERS[cluster], device_type, name, memory) is None


def test_a_gpu_plan_on_cpu_processes_says_so_and_how_to_plan_for_them():
    warning = device_mismatch(A100_80, "cpu")
    assert warning.startswith("the plan is for dgx-a100-80g (A100-SXM4-80GB, 80 GB) but this run has no GPU")
    assert "--cluster cpu-local" in warning


@pytest.mark.parametrize("cluster, name, memory, found", [
    ("dgx-a100-80g", "NVIDIA A100-SXM4-40GB", 42_400_000_000, "NVIDIA A100-SXM4-40GB (42 GB)"),  # memory
    ("dgx-h100", "NVIDIA H200", 150_000_000_000, "NVIDIA H200 (150 GB)"),  # name and memory
    ("dgx-h100", "NVIDIA A100-SXM4-80GB", 85_100_000_000, "NVIDIA A100-SXM4-80GB (85 GB)"),  # name
])
def test_another_gpu_is_named_beside_the_plans(cluster, name, memory, found):
    warning = device_mismatch(BUILTIN_CLUSTERS[cluster], "cuda", name, memory)
    spec = BUILTIN_CLUSTERS[cluster]
    assert f"the plan is for {cluster} ({spec.gpu.name}, {spec.gpu.hbm_bytes / 1e9:.0f} GB)" in warning
    assert f"this run is on {found}" in warning


def test_a_cpu_plan_on_a_gpu_says_so():
    warning = device_mismatch(CPU_LOCAL, "cuda", "NVIDIA H200", 150_000_000_000)
    assert warning.startswith("the plan is for CPU processes (cpu-local) but this run is on NVIDIA H200")


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_0_prints_the_warning_once_on_stderr(model_file, capsys, rank):
    plan = plan_for(model_file).model_copy(update={"cluster": A100_80})
    ctx = RunContext(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), backend="gloo")
    warning = warn_if_other_devices(plan, ctx)
    assert warning == device_mismatch(A100_80, "cpu")
    printed = capsys.readouterr()
    assert printed.out == ""
    assert printed.err == (f"zplan: warning: {warning}\n" if rank == 0 else "")
    assert warn_if_other_devices(plan_for(model_file), ctx) is None  # cpu-local on the CPU
    assert capsys.readouterr().err == ""
