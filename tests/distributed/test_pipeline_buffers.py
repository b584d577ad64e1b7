"""Pipeline receive buffers for the micro-batches in flight only (runtime/parallel/pipeline_buffers.py), under gloo.

examples/tiny.py (4 blocks, tied head) on pp 2 with 8 micro-batches, 2 steps, once through the runtime's InFlightStage
and once through torch's own PipelineStage in the same processes: under 1F1B, 1F1B with int8 activations
(runtime/compression/activations.py: the int8 rows are what is received) and interleaved 1F1B (2 chunks a rank).
Every receive buffer either stage allocates (torch's _make_tensor_from_meta) is watched by a weak reference. Under
1F1B torch's stages hold 8 at once, one per micro-batch of the step (the first stage's gradients, the last stage's
activations), the runtime's at most 2 (1F1B on pp 2 has one micro-batch in flight on a stage's receiving side; the
schedule's last P2P op still references the one before until the next receive is posted); interleaved, fewer than
torch's 24 (8 of each of the 3 kinds a rank receives). Losses and gradients are bit for bit torch's.

The workers are this file run as a script (tests/distributed/harness.py Ranks).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from pathlib import Path

import pytest
import torch

PP, NUM_MICRO_BATCHES, STEPS = 2, 8, 2
IN_FLIGHT_BOUND = 2  # the module docstring's count for 1F1B on pp 2
RUNS = {"1f1b": ("1f1b", 2, "none"), "1f1b-int8": ("1f1b", 2, "int8"),  # name -> (schedule, stages, activations)
        "interleaved-1f1b": ("interleaved-1f1b", 4, "none")}


# ---- the worker -------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def watched_buffers():
    """Count the receive buffers alive at once: yields {'most': ...}, updated on every allocation."""
    from torch.distributed.pipelining import stage

    from zplan.runtime.parallel import pipeline_buffers

    original = stage._make_tensor_from_meta
    live: weakref.WeakSet = weakref.WeakSet()
    counts = {"most": 0}

    def make(meta, device):
        tensor = original(meta, device)
        live.add(tensor)
        counts["most"] = max(counts["most"], len(live))
        return tensor

    stage._make_tensor_from_meta = pipeline_buffers._make_tensor_from_meta = make
    try:
        yield counts
    finally:
        stage._make_tensor_from_meta = pipeline_buffers._make_tensor_from_meta = original


@contextlib.contextmanager
def torch_stages():
    """runtime.parallel.pipeline builds torch's own PipelineStage (it imports InFlightStage when it builds one)."""
    from torch.distributed.pipelining import PipelineStage

    from zplan.runtime.parallel import pipeline_buffers

    in_flight = pipeline_buffers.InFlightStage
    pipeline_buffers.InFlightStage = PipelineStage
    try:
        yield
    finally:
        pipeline_buffers.InFlightStage = in_flight


def train(mesh, schedule: str, num_stages: int, activations: str) -> dict:
    """STEPS steps of `schedule` on this rank's stages: the losses, each step's gradients, the most buffers alive at
    once."""
    from tests.distributed.test_pipeline import (
        FOUR_STAGES,
        MICRO_BATCH,
        SEED,
        SEQ_LEN,
        TWO_STAGES,
        UNITS,
        VOCAB,
        next_token_loss,
        tiny_model,
    )
    from zplan.runtime.parallel.pipeline import build_pipeline, stage_module_paths
    from zplan.runtime.training.data import synthetic_token_batch

    torch.manual_seed(SEED)
    example = torch.zeros(MICRO_BATCH, SEQ_LEN, dtype=torch.long)
    stages = stage_module_paths({2: TWO_STAGES, 4: FOUR_STAGES}[num_stages], UNITS)
    run = build_pipeline(tiny_model(), mesh["pp"], stages, schedule, NUM_MICRO_BATCHES, next_token_loss, example,
                         activation_compression=activations)
    losses, grads = [], []
    with watched_buffers() as counts:
        for step in range(STEPS):
            tokens = synthetic_token_batch(VOCAB, SEQ_LEN, MICRO_BATCH * NUM_MICRO_BATCHES, SEED, step)  # (B, T)
            micro_batches = list(tokens.split(MICRO_BATCH))
            losses.append(run.step(micro_batches))
            grads.append({name: p.grad.clone() for name, p in run.named_parameters()})
            with torch.no_grad():  # a plain update, so that step 2 runs on other weights
                for p in run.parameters():
                    p -= 1e-2 * p.grad
                    p.grad = None
    return {"losses": losses, "grads": grads, "most_buffers": counts["most"]}


def worker(out_dir: str) -> None:
    from zplan.runtime.launch.distributed import run_distributed
    from zplan.runtime.parallel.mesh import build_mesh

    def work(ctx) -> None:
        mesh = build_mesh(pp=PP, dp=1, tp=1, device_type="cpu")
        results = {}
        for name, run in RUNS.items():
            in_flight = train(mesh, *run)
            with torch_stages():
                results[name] = {"in_flight": in_flight, "torch": train(mesh, *run)}
        torch.save(results, Path(out_dir) / f"rank{ctx.rank}.pt")

    run_distributed(work)


# ---- the test ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """Each pipeline rank's results: {run name: {"in_flight": ..., "torch": ...}} (worker)."""
    from tests.distributed.harness import Ranks

    out = tmp_path_factory.mktemp("pipeline_buffers")
    Ranks([__file__, str(out)], PP, out / "logs").wait_ok()
    return [torch.load(out / f"rank{rank}.pt") for rank in range(PP)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_buffers_for_the_micro_batches_in_flight_only_and_torch_s_gradients(name, runs):
    for rank, got in enumerate(runs):
        mine, theirs = got[name]["in_flight"], got[name]["torch"]
        print(f"{name}, pipeline rank {rank}: receive buffers alive at once: {mine['most_buffers']} (torch's stage: "
              f"{theirs['most_buffers']})")
        kinds = 3 if name.startswith("interleaved") else 1  # what a rank receives: activations and gradients a chunk
        assert theirs["most_buffers"] == kinds * NUM_MICRO_BATCHES  # the watch sees torch's one per micro-batch
        if kinds == 1:
            assert 1 <= mine["most_buffers"] <= IN_FLIGHT_BOUND
        else:
            assert 1 <= mine["most_buffers"] < theirs["most_buffers"]
        for a, b in zip(mine["losses"], theirs["losses"], strict=True):
            assert torch.equal(a, b)
        for step_mine, step_theirs in zip(mine["grads"], theirs["grads"], strict=True):
            assert step_mine.keys() == step_theirs.keys()
            assert all(torch.equal(step_mine[param], step_theirs[param]) for param in step_mine)


if __name__ == "__main__":
    worker(sys.argv[1])
