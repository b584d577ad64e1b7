"""One rank of a plan's program on fake tensors, its memory counted: the dry run's inner loop (zplan.dryrun).

    figures = dry_run_rank(plan, model_path, rank, settings)

Becomes `rank` of a fake world of the plan's size (runtime.dryrun.fake_world) and makes the calls train.py makes, in its
order: plan_mesh, build_meta_model, parallelize (tensor parallel, recompute, pipeline stage and schedule, DDP /
ZeRO-1 / FSDP2, offload, the weights made), plan_optimizer, then `steps` optimizer steps of
runtime.training.step.optimizer_step on the synthetic batches make_data_iter gives. runtime.dryrun.live_memory counts
every storage from the build on; its peak starts again once the build is done, so the figures are those of the steps
with everything the build left (model states, DDP's buckets, ZeRO-1's sharded states) included.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from zplan.model.model_file import load_model_file
from zplan.runtime.dryrun.fake_world import drop_cached_tensors, fake_tensors, fake_world
from zplan.runtime.dryrun.live_memory import LiveMemory, local_tensor
from zplan.runtime.parallel.data_parallel import fsdp_param_groups
from zplan.runtime.plan.apply import parallelize, plan_data_iter, plan_loss_fn, plan_mesh, plan_optimizer
from zplan.runtime.training.data import make_data_iter
from zplan.runtime.training.materialize import _cpu_offloaded, build_meta_model, weight_roots
from zplan.runtime.training.step import clear_gradients, loss_scaler, optimizer_step
from zplan.schemas.spec import Tier


@dataclass(frozen=True)
class TrainSettings:
    """train.py's hyper-parameters that shape what the optimizer holds."""

    lr: float
    weight_decay: float
    grad_clip: float


@dataclass(frozen=True)
class RankFigures:
    peak_bytes: int  # device bytes allocated at the peak of the steps
    by_category: dict  # near the peak (runtime.dryrun.live_memory)
    host_peak_bytes: int  # offloaded states in host memory
    seconds: float


def _storage_id(tensor: torch.Tensor) -> int:
    return id(local_tensor(tensor).untyped_storage())


def _fsdp_params(roots: list[nn.Module]) -> list:
    """FSDP2's FSDPParam objects under `roots` (their sharded and unsharded tensors)."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for root in roots:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                for group in fsdp_param_groups(module):
                    found.extend(group.fsdp_params)
    return found


class StateStorages:
    """{category: storage ids} of the model's parameters (FSDP2's shards and gathered copies too), their gradients
    and the optimizer's states, for LiveMemory's breakdown. The parameters' and states' storages are read at
    refresh() (they keep their storages: FSDP2 resizes its gathered ones in place); the gradients at every call."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.roots, self.optimizer = weight_roots(model), optimizer
        self.refresh()

    def refresh(self) -> None:
        params = {id(p): p for root in self.roots for p in root.parameters()}
        for fsdp_param in _fsdp_params(self.roots):
            for tensor in (fsdp_param.sharded_param, getattr(fsdp_param, "_unsharded_param", None)):
                if tensor is not None:
                    params[id(tensor)] = tensor
        self.params = list(params.values())
        states = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        states += list(getattr(self.optimizer, "host_buffers", lambda: [])())
        self.ids = {"parameters": {_storage_id(p) for p in self.params}, "optimizer": {_storage_id(v) for v in states}}

    def __call__(self) -> dict[str, set[int]]:
        grads = {_storage_id(p.grad) for p in self.params if p.grad is not None}
        return {**self.ids, "gradients": grads}

    def host_ids(self, offload: Tier) -> set[int]:
        """Storage ids of what an offload keeps in host memory (LiveMemory.mark_host): with an offload tier every
        optimizer state and buffer (the optimizer steps on the CPU: runtime.offload), and the parameter and
        gradient shards that FSDP2's CPUOffloadPolicy keeps on the host."""
        ids = set(self.ids["optimizer"]) if offload != "none" else set()
        offloaded = _cpu_offloaded(self.roots)
        for parameter in self.params:
            if id(parameter) in offloaded:
                ids.add(_storage_id(parameter))
                if parameter.grad is not None:
                    ids.add(_storage_id(parameter.grad))
        return ids


def measure_steps(plan, model_path: Path, settings: TrainSettings, steps: int, ctx, say: Callable[[str], None],
                  fake: bool = True) -> RankFigures:
    """Build this rank's part of `plan` and run `steps` optimizer steps, every storage counted (module docstring):
    on fake tensors (`fake`, inside runtime.dryrun.fake_world), or on real ones in a real process group (the dry run's
    honesty check, tests/distributed/test_dry_run_vs_real.py: the same code, the same meter)."""
    import contextlib

    p = plan.parallel
    model_file = load_model_file(model_path)
    nvme_dir = None
    start = time.perf_counter()
    mesh = plan_mesh(plan, ctx.device.type)  # outside the fake mode: a mesh is real ranks
    with fake_tensors() if fake else contextlib.nullcontext(), LiveMemory() as meter:  # from the build on
        say(f"rank {ctx.rank}: building the model{' on fake tensors' if fake else ''}")
        model, weights = build_meta_model(model_file.build_model, seed=0, device=ctx.device)
        say(f"rank {ctx.rank}: applying the plan ({plan_words(plan)}), making its weights and optimizer")
        model, _ = parallelize(model, weights, mesh, plan, model_file, ctx.device)
        if p.offload == "nvme":
            import tempfile

            nvme_dir = tempfile.TemporaryDirectory(prefix="zplan-dryrun-nvme-")
        optimizer = plan_optimizer(model, mesh, plan, lr=settings.lr, weight_decay=settings.weight_decay,
                                   steps=steps, nvme_path=nvme_dir.name if nvme_dir else None)
        data = make_data_iter(model_file, vocab=plan.model.vocab, seq_len=plan.train.seq_len,
                              micro_batch=p.micro_batch, num_micro_batches=p.num_micro_batches,
                              dp_rank=mesh["dp"].get_local_rank(), dp_size=p.dp, seed=0)
        data, loss_fn = plan_data_iter(plan, mesh, data, model), plan_loss_fn(plan, model_file)  # cp: a part
        scaler = loss_scaler(model, optimizer, plan.train.precision, ctx.device)
        del weights
        if fake:
            drop_cached_tensors()
        storages = StateStorages(model, optimizer)
        meter.classify = storages
        meter.mark_host(storages.host_ids(p.offload))  # what an offload made on the host with the optimizer
        meter.reset_peak()  # the build's transient tensors (the initialisation's replay, on the host) are gone
        meter.phase = "forward"
        model.train()
        micro_batches = f"{p.num_micro_batches} micro-batch{'es' if p.num_micro_batches > 1 else ''}"
        for step in range(steps):
            say(f"rank {ctx.rank}: step {step + 1}/{steps}: forward and backward of {micro_batches}, optimizer step")
            optimizer_step(model, optimizer, data, loss_fn, p.num_micro_batches, settings.grad_clip,
                           scaler, ctx.device)
            clear_gradients(model, optimizer)
            if step == 0:  # the optimizer's states exist now (a lazy optimizer makes them in its first step)
                storages.refresh()
                meter.mark_host(storages.host_ids(p.offload))
        if hasattr(optimizer, "close"):
            optimizer.close()
    if nvme_dir is not None:
        nvme_dir.cleanup()
    seconds = time.perf_counter() - start
    say(f"rank {ctx.rank}: done in {seconds:.1f} s, peak {meter.peak_bytes / 2**30:.2f} GiB allocated")
    return RankFigures(meter.peak_bytes, meter.record.by_category, meter.host_peak_bytes, seconds)


def plan_words(plan) -> str:
    """The plan's split in a few words for a progress line, e.g. "dp 4 x cp 2, ZeRO-3, recompute none"."""
    p = plan.parallel
    split = " x ".join(f"{name} {size}" for name, size in (("tp", p.tp), ("pp", p.pp), ("dp", p.dp), ("cp", p.cp))
                       if size > 1) or "one GPU"
    offload = f", offload {p.offload}" if p.offload != "none" else ""
    return f"{split}, ZeRO-{p.zero_stage}, recompute {p.recompute}{offload}"


def dry_run_rank(plan, model_path: Path, rank: int, settings: TrainSettings, steps: int,
                 say: Callable[[str], None]) -> RankFigures:
    """Be `rank` of the plan's world, alone in a fake world, and measure_steps on fake tensors."""
    p = plan.parallel
    with fake_world(rank, p.tp * p.pp * p.dp * p.cp, plan.cluster.gpus_per_node) as ctx:
        return measure_steps(plan, model_path, settings, steps, ctx, say, fake=True)
