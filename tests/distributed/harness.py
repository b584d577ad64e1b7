"""What the multi-process tests share: emit train.py for a plan, launch ranks the way torchrun would,
read their logs, and the single-process reference they are compared with.

Each rank is a child of one fork server that has imported torch and zplan's runtime once: a fresh
interpreter spends ~4 s of CPU on those imports, most of these tests' time on 2 cores otherwise. The rank
then runs its script as __main__ (runpy) with the environment torchrun gives it (RANK, WORLD_SIZE,
MASTER_ADDR, ...), so the script's code path is the same as under torchrun.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from zplan.codegen.script import render_script_files
from zplan.runtime.training.data import synthetic_token_batch
from zplan.runtime.training.loop import WarmupCosine
from zplan.schemas import Plan

REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 240  # for a whole launch; a rank still running then is killed
WEIGHT_DECAY = 0.1  # train.py's defaults, which the references use too
GRAD_CLIP = 1.0

_PRELOAD = ["torch", "torch.distributed.tensor.parallel", "torch.distributed.fsdp",
            "zplan.runtime.parallel.data_parallel", "zplan.runtime.checkpoint.save",
            "zplan.runtime.parallel.pipeline", "zplan.runtime.training.main", "rich.progress",
            # what a Hugging Face model's build imports (with torchao installed, transformers' quantizers import it)
            "transformers.quantizers.auto", "transformers.models.llama.modeling_llama",
            __name__]  # this module: each rank unpickles _rank_main from it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def import_file(path: Path, name: str):
    """The Python file `path` imported as a module called `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- launching ranks --------------------------------------------------------------------------------


def _rank_main(argv: list[str], env: dict[str, str | None], log_path: str) -> None:
    """One rank: output to `log_path`, environment `env` (None unsets), then `python argv...`; exits
    with its status."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    torch.set_num_threads(1)  # OMP_NUM_THREADS is read when torch loads, which was before the fork
    sys.argv = list(argv)
    status = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class Ranks:
    """`python argv...` started as `world` ranks with the environment torchrun gives them, plus `env`
    (a value None unsets a variable); a world of one is a plain process, without torchrun's variables.
    On `device` "cpu" (gloo, GPUs hidden) or "cuda" (NCCL, one GPU per rank). Each rank's stdout and
    stderr go to one log file in `log_dir`."""

    def __init__(self, argv: list[str], world: int, log_dir: Path, *, env: dict[str, str | None] | None = None,
                 device: str = "cpu"):
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)  # takes effect when the fork server starts (first use)
        log_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.monotonic_ns()  # several launches may log to one folder
        self.logs = [log_dir / f"rank{rank}.{stamp}.log" for rank in range(world)]
        port = str(free_port())
        self.processes = []
        for rank, log in enumerate(self.logs):
            # device "cpu" hides any GPU, so that the runtime picks gloo on a GPU machine too;
            # "cuda": rank r uses GPU r with NCCL (tests/gpu)
            hide_gpus = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}
            rank_env = {"OMP_NUM_THREADS": "1", **hide_gpus, **(env or {})}
            if world > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                                LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            process = context.Process(target=_rank_main, args=(list(argv), rank_env, str(log)))
            process.start()
            self.processes.append(process)

    def output(self) -> str:
        """Every rank's output so far, rank 0 first."""
        return "\n".join(f"--- rank {rank}\n" + (log.read_text() if log.exists() else "(did not start)")
                         for rank, log in enumerate(self.logs))

    def wait(self, timeout_s: float = LAUNCH_TIMEOUT_S) -> int:
        """Wait for the ranks to end (a rank still running after `timeout_s`, e.g. in a hung collective,
        is killed); return the worst exit status."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self.kill()
        return max(abs(p.exitcode) if p.exitcode is not None else 1 for p in self.processes)

    def wait_ok(self, timeout_s: float = LAUNCH_TIMEOUT_S) -> str:
        """Wait for a normal end of every rank; return their output."""
        assert self.wait(timeout_s) == 0, self.output()[-8000:]
        return self.output()

    def kill_when_paused(self, text: str, timeout_s: float = LAUNCH_TIMEOUT_S) -> None:
        """Wait until rank 0 printed `text` (it sleeps there), then SIGKILL every rank."""
        deadline = time.monotonic() + timeout_s
        while not (self.logs[0].exists() and text in self.logs[0].read_text()):
            assert time.monotonic() < deadline, "never paused:\n" + self.output()[-8000:]
            assert self.processes[0].is_alive(), "ended before pausing:\n" + self.output()[-8000:]
            time.sleep(0.1)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the ranks still running."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()


# ---- the emitted script --------------------------------------------------------------------------------


def emit(plan: Plan, model_path: Path | None, out_dir: Path) -> Path:
    """Write plan.json, train.py (naming `model_path` relative to it) and the launchers for `plan` into
    `out_dir` (new); return train.py."""
    out_dir.mkdir(parents=True)
    (out_dir / "plan.json").write_text(plan.model_dump_json(indent=2))
    render_script_files(plan, out_dir, os.path.relpath(model_path, out_dir) if model_path else None)
    return out_dir / "train.py"


def train_args(steps: int, seed: int, lr: float, log: Path) -> list[str]:
    """train.py's arguments for `steps` steps from `seed` at peak learning rate `lr`, logging to `log`."""
    return ["--steps", str(steps), "--seed", str(seed), "--lr", str(lr), "--log-json", str(log)]


def read_log(log: Path) -> list[dict]:
    """The records of a --log-json file, one per step."""
    return [json.loads(line) for line in log.read_text().splitlines()]


def run_emitted_script(plan: Plan, model_path: Path, out_dir: Path, *, steps: int, seed: int, lr: float,
                       via_launcher: bool = False, device: str = "cpu",
                       extra_args: tuple[str, ...] = ()) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Emit train.py for `plan` and run it on the plan's world size (with launch/torchrun.sh, that is real
    torchrun, when via_launcher) on `device` (see Ranks), with `extra_args` for train.py; return (per-step
    records, final weights on the CPU)."""
    script = emit(plan, model_path, out_dir)
    log, weights = out_dir / "log.jsonl", out_dir / "weights.pt"
    args = [*train_args(steps, seed, lr, log), "--save-weights", str(weights), *extra_args]
    if via_launcher:
        env = {**os.environ, "TORCHRUN": str(Path(sys.executable).parent / "torchrun"), "OMP_NUM_THREADS": "1",
               **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}
        result = subprocess.run(["bash", str(out_dir / "launch" / "torchrun.sh"), *args], capture_output=True,
                                text=True, env=env, timeout=LAUNCH_TIMEOUT_S)
        assert result.returncode == 0, (result.stdout[-3000:] + result.stderr[-5000:])[-8000:]
    else:
        Ranks([str(script), *args], plan.fingerprint.world_size, out_dir / "logs", device=device).wait_ok()
    return read_log(log), torch.load(weights, map_location="cpu")


# ---- the single-process reference ----------------------------------------------------------------------


class LogitsOf(torch.nn.Module):
    """A Hugging Face causal LM that returns its logits (B, T, V), as train_single_process calls a model: tokens
    (B, T) -> logits."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits



def train_single_process(build_model: Callable[[], torch.nn.Module], *, steps: int, seed: int, lr: float,
                         global_batch: int, vocab: int, seq_len: int, device: str = "cpu",
                         dtype: torch.dtype = torch.float32, parts: int = 1
                         ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """What the emitted script must reproduce: one process, the whole global batch at once, plain torch
    AdamW (fused, as the runtime uses) under the same LR schedule and clipping, on `device`;
    (losses, final weights on the CPU). `dtype` bf16/fp16: mixed precision as the ZeRO paper has it, written here
    from scratch: the model's parameters in `dtype`, an fp32 master copy of each that AdamW steps on the gradient
    upcast, the parameter then rounded from it; the loss in fp32 on the 16-bit logits; the masters returned.
    `parts` > 1: each step's batch runs as that many consecutive slices whose gradients accumulate (each loss /
    parts; the step's loss is their sum), so that an op that depends on its whole input (fp8's per-tensor scale)
    sees the rows one data-parallel rank of `parts` sees."""
    torch.manual_seed(seed)
    model = build_model().to(device)
    params = list(model.parameters())
    masters = params
    if dtype != torch.float32:
        masters = [p.detach().clone() for p in params]  # fp32: the weights as built
        for p in params:
            p.data = p.data.to(dtype)
    optimizer = torch.optim.AdamW(
        [{"params": [m for m in masters if m.dim() >= 2], "weight_decay": WEIGHT_DECAY},
         {"params": [m for m in masters if m.dim() < 2], "weight_decay": 0.0}], lr=lr, fused=True,
    )
    schedule = WarmupCosine(max_lr=lr, warmup_steps=max(1, steps // 10), total_steps=steps)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule(step)
        tokens = synthetic_token_batch(vocab, seq_len, global_batch, seed, step).to(device)  # (B, T)
        loss = 0.0
        for part in tokens.chunk(parts):  # (B / parts, T)
            logits = model(part)  # (B / parts, T, V)
            part_loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), part[:, 1:].reshape(-1)) / parts
            part_loss.backward()
            loss = loss + part_loss.detach()
        for p, master in zip(params, masters, strict=True):
            if master is not p:
                master.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(masters, GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad()
        model.zero_grad()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)
        losses.append(loss.item())
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    master_of = {id(p): master for p, master in zip(params, masters, strict=True)}
    for name, p in model.named_parameters(remove_duplicate=False):  # the masters, under every name (tied too)
        weights[name] = master_of[id(p)].detach().cpu().clone()
    return losses, weights


def max_loss_diff(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(losses, reference, strict=True))


def max_weight_diff(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference over all parameters (the two hold the same names)."""
    assert set(weights) == set(reference)
    return max((weights[k] - reference[k]).abs().max().item() for k in reference)


def mean_weight_diff(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The mean elementwise difference over all parameters (the two hold the same names)."""
    assert set(weights) == set(reference)
    total = sum((weights[k] - reference[k]).abs().sum().item() for k in reference)
    return total / sum(t.numel() for t in reference.values())
