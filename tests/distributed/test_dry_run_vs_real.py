"""The dry run's honesty check: the same program on the same plan, run for real by 2 gloo processes on real tensors
(tests/distributed/dry_run_worker.py: runtime.dryrun.dry_run.measure_steps with fake=False) and by the dry run on fake
tensors, counted by the same meter (runtime.dryrun.live_memory): the peaks of each stage's rank agree within 5 %. The
plans cover DDP (whose reducer the dry run stands in for: runtime.dryrun.fake_world.FakeRankDDP) inside pipeline
stages, in fp32 and with bf16 parameters (ZeRO-1: fp32 masters in the optimizer), FSDP2 with DTensor tensor parallel,
ZeRO-1 under tensor parallel (runtime.parallel.grad_reduce's buckets), and ZeRO-1 with its optimizer offloaded to the
CPU (the host bytes too: the offloaded masters and moments)."""

import json
from pathlib import Path

import pytest

from tests.distributed.harness import Ranks
from tests.hf_zoo import write_model_files
from zplan.api import compile_plan, prepare, write_outputs
from zplan.dryrun import dry_run, load_program
from zplan.schemas.spec import Pins

WORKER = Path(__file__).with_name("dry_run_worker.py")


@pytest.mark.parametrize("pins, precision", [(dict(pp=2, zero=0), "fp32"), (dict(pp=2, zero=1), "bf16"),
                                              (dict(tp=2, zero=3), "fp32"), (dict(tp=2, zero=1), "bf16"),
                                              (dict(dp=2, zero=1, offload="cpu"), "bf16")],
                         ids=["pp2-ddp", "pp2-zero1-bf16", "tp2-zero3", "tp2-zero1-bf16", "zero1-cpu-offload-bf16"])
def test_fake_peak_equals_real_peak(tmp_path, pins, precision):
    model = write_model_files(tmp_path / "zoo")["llama"]
    plan = compile_plan(prepare(str(model), 2, "cpu-local", 4, 32, precision, Pins(**pins)))
    out = tmp_path / "out"
    write_outputs(plan, out, str(model))

    fake = dry_run(load_program(out), say=lambda message: None)
    prefix = tmp_path / "real"
    Ranks([str(WORKER), str(out), str(model), str(prefix)], 2, tmp_path / "logs").wait_ok()
    for rank in fake.ranks:
        real = json.loads(Path(f"{prefix}.rank{rank.rank}.json").read_text())
        print(f"{pins} rank {rank.rank}: fake {rank.measured_peak_bytes} B, real {real['peak_bytes']} B")
        assert rank.measured_peak_bytes == pytest.approx(real["peak_bytes"], rel=0.05)
        assert rank.host_peak_bytes == pytest.approx(real["host_peak_bytes"], rel=0.05)
