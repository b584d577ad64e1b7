"""What the emitted train.py runs: it pins its plan.json and its hyper-parameters as constants and hands them here.

    if __name__ == "__main__":
        sys.exit(train_main(Path(__file__).resolve().parent, model_file=MODEL_FILE, planned_for=PLANNED_FOR,
                            plan_digest=PLAN_DIGEST, lr=LR, weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP,
                            doc=__doc__))

train_main parses the command line (runtime/launch/arguments.py), then in a process group
(runtime/launch/distributed.py) run_training does, in this order: plan.json beside train.py loaded and checked against
train.py's record of it (runtime/plan/origin.py), the model file and the world size (runtime/plan/check.py), every
output checked writable, the model built on the meta device, the plan applied (runtime/plan/apply.py, docs/design.md
decision 5), the optimizer, the data and context-parallel wiring, the checkpoint settings and LR schedule, train(),
the weights saved.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from types import ModuleType

import torch.distributed as dist

from zplan.errors import ZplanError
from zplan.model.model_file import load_model_file
from zplan.runtime.checkpoint.folders import LATEST, LATEST_VALID, latest_checkpoint, latest_valid_checkpoint
from zplan.runtime.checkpoint.pretrained import (
    init_from_path,
    load_pretrained,
    load_pretrained_masters,
    open_pretrained,
)
from zplan.runtime.checkpoint.save import CheckpointConfig
from zplan.runtime.checkpoint.weights_file import save_full_weights
from zplan.runtime.launch.arguments import parse_train_arguments
from zplan.runtime.launch.distributed import RunContext, run_distributed
from zplan.runtime.launch.torchrun import report_error
from zplan.runtime.plan.apply import (
    parallelize,
    plan_data_iter,
    plan_loss_fn,
    plan_mesh,
    plan_optimizer,
    train_config,
    warn_if_other_devices,
)
from zplan.runtime.plan.check import check_plan, load_plan
from zplan.runtime.plan.origin import check_plan_origin
from zplan.runtime.training.data import make_data_iter, open_run_data
from zplan.runtime.training.loop import WarmupCosine, train
from zplan.runtime.training.materialize import build_meta_model
from zplan.runtime.training.outputs import check_output_paths
from zplan.runtime.training.run_log import tensorboard_writer_class
from zplan.runtime.training.validation import make_validation

DEFAULT_KEEP = 3  # checkpoints kept without --keep


@dataclasses.dataclass(frozen=True)
class TrainScript:
    """An emitted train.py's constants: its folder (plan.json lies there), the model file relative to it (None for
    a family spec), what its plan was made for and its digest, its hyper-parameters and docstring (--help's text)."""

    here: Path
    model_file: str | None
    planned_for: dict
    plan_digest: str
    lr: float
    weight_decay: float
    grad_clip: float
    doc: str | None = None


def script_of(module: ModuleType) -> TrainScript:
    """The constants of an imported train.py (tests run its run_training in a process group of their own)."""
    return TrainScript(Path(module.__file__).resolve().parent, module.MODEL_FILE, module.PLANNED_FOR,
                       module.PLAN_DIGEST, module.LR, module.WEIGHT_DECAY, module.GRAD_CLIP, module.__doc__)


def parse_script_arguments(script: TrainScript, argv: list[str] | None = None) -> argparse.Namespace:
    """train.py's command line (`argv`, default sys.argv[1:]); a bad value exits with status 2."""
    return parse_train_arguments(script.doc, script.lr, argv)


def checkpoint_to_resume(resume: str | None, directory: str | None, ctx: RunContext) -> str | Path | None:
    """--resume's checkpoint, decided before any weights are read, so that a resume skips --init-from's (the
    checkpoint's replace them): the path given; for 'latest' the newest complete checkpoint in `directory`, for
    'latest-valid' the newest whose files match its manifest (why newer ones were passed over printed), decided on
    rank 0 for every rank; the word itself when there is none yet (train() says so and starts at step 0)."""
    if resume not in (LATEST, LATEST_VALID) or directory is None:
        return resume
    choice: list[str | None] = [None]
    if ctx.is_main:
        if resume == LATEST:
            newest, skipped = latest_checkpoint(directory), []
        else:
            newest, skipped = latest_valid_checkpoint(directory)
        if newest is not None:  # else train() looks again, and says what it passed over
            for reason in skipped:
                print(f"zplan: --resume {LATEST_VALID}: passing over {reason}", flush=True)
            choice = [str(newest)]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else resume


def run_training(args: argparse.Namespace, ctx: RunContext, script: TrainScript) -> None:
    """One rank's run of train.py with `args` in the process group `ctx`."""
    plan = load_plan(script.here / "plan.json")
    model_path = Path(args.model) if args.model else (script.here / script.model_file if script.model_file else None)
    # train.py's plan.json, for this model
    edited = check_plan_origin(plan, script.planned_for, script.plan_digest, model_path)
    if edited and ctx.is_main:
        print(f"zplan: note: {edited}", flush=True)
    check_plan(plan, model_path, ctx.world_size)  # before any collective
    warn_if_other_devices(plan, ctx)  # rank 0: one line on stderr when the plan was made for other devices
    if args.tensorboard:  # every rank, before the first collective: all stop together when it is not installed
        tensorboard_writer_class()
    model_file = load_model_file(model_path)
    # a resume's checkpoint, decided now (a collective when --resume [latest|latest-valid]): its weights replace
    # --init-from's, which are then not read
    resume = checkpoint_to_resume(args.resume, args.checkpoint_dir, ctx)
    resuming = resume is not None and resume not in (LATEST, LATEST_VALID)
    # the weights to start from (--init-from; default: those of the Hugging Face folder the plan was compiled from),
    # their files and tensors checked against the model on every rank before any collective
    init_from = init_from_path(args.init_from, plan.fingerprint.init_from, model_path)
    pretrained = None if resuming else open_pretrained(init_from, model_file)
    if resuming and init_from is not None and ctx.is_main:
        print(f"zplan: resuming from {resume}: the weights of --init-from {init_from} are not read", flush=True)
    p = plan.parallel
    # --data and --val-data opened and checked on every rank before any collective (runtime/training/data.py)
    run_data = open_run_data(model_file, data=args.data, val_data=args.val_data, tokenizer=args.tokenizer,
                             vocab=plan.model.vocab, seq_len=plan.train.seq_len,
                             global_batch=p.dp * p.num_micro_batches * p.micro_batch, eval_batches=args.eval_batches)
    # every output writable on every rank before the first step (one all-reduce), or nothing is trained
    check_output_paths(ctx, save_weights=args.save_weights, log_json=args.log_json, checkpoint_dir=args.checkpoint_dir,
                       tensorboard=args.tensorboard)

    mesh = plan_mesh(plan, ctx.device.type)
    # The model on the meta device; its initialisation is recorded, to be replayed shard by shard by
    # parallelize with the weights of `torch.manual_seed(seed); build_model()` in one process.
    model, weights = build_meta_model(model_file.build_model, seed=args.seed, device=ctx.device)
    # plan.json applied in its fixed order (runtime/plan/apply.py): tensor parallel, recompute, pipeline,
    # data parallel (ZeRO stage, precision, offload, compression), the weights made where they belong.
    model, materialized = parallelize(model, weights, mesh, plan, model_file, ctx.device)
    if ctx.is_main:
        print(f"zplan: {materialized}", flush=True)  # host bytes the weights took on this rank
    loaded = load_pretrained(pretrained, model, ctx)  # this rank's slices of the pretrained weights, in place
    if loaded and ctx.is_main:
        print(f"zplan: {loaded}", flush=True)
    optimizer = plan_optimizer(model, mesh, plan, lr=args.lr, weight_decay=script.weight_decay, steps=args.steps,
                               nvme_path=args.nvme_path, onebit_warmup_steps=args.onebit_warmup_steps)
    load_pretrained_masters(pretrained, model, optimizer, ctx)  # fp32 masters of 16-bit parameters: the file's values
    data = make_data_iter(model_file, vocab=plan.model.vocab, seq_len=plan.train.seq_len, micro_batch=p.micro_batch,
                          num_micro_batches=p.num_micro_batches, dp_rank=mesh["dp"].get_local_rank(), dp_size=p.dp,
                          seed=args.seed, data=run_data.train)
    token_data = data if run_data.train is not None else None  # its position goes into checkpoints
    validation = None if run_data.val is None else make_validation(
        run_data.val, seq_len=plan.train.seq_len, micro_batch=p.micro_batch, num_micro_batches=p.num_micro_batches,
        dp_rank=mesh["dp"].get_local_rank(), dp_size=p.dp, eval_batches=args.eval_batches, every=args.eval_every,
        wrap=lambda batches: plan_data_iter(plan, mesh, batches, model))
    # whole sequences per data-parallel rank; with context parallel (cp > 1) each cp rank's part of them, and the
    # next-token loss of that part (runtime/parallel/context_parallel.py)
    data, loss_fn = plan_data_iter(plan, mesh, data, model), plan_loss_fn(plan, model_file)
    warmup_steps = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10)
    checkpoint = CheckpointConfig(
        directory=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
        every=args.checkpoint_every, keep=DEFAULT_KEEP if args.keep is None else args.keep, resume=resume,
        allow_unverified=args.allow_unverified,
        model_ref=str(model_path) if model_path else plan.fingerprint.model_ref,  # for `zplan export --hf`
    )
    schedule = WarmupCosine(max_lr=args.lr, warmup_steps=warmup_steps, total_steps=args.steps)
    config = train_config(plan, steps=args.steps, lr_schedule=schedule, grad_clip=script.grad_clip,
                          log_json=args.log_json, checkpoint=checkpoint)
    config = dataclasses.replace(config, allow_nonfinite_loss=args.allow_nonfinite_loss, tensorboard=args.tensorboard,
                                 data=token_data, data_path=args.data, allow_other_data=args.allow_other_data,
                                 validation=validation)
    train(model, optimizer, data, loss_fn, config, ctx)
    if args.save_weights:
        save_full_weights(model, args.save_weights, ctx, optimizer)  # fp32 master weights
    if hasattr(optimizer, "close"):  # NVMe offload: removes this rank's swap files (an interrupted run's go at
        optimizer.close()  # exit, on SIGTERM or at the next start)


def train_main(here: Path, *, model_file: str | None, planned_for: dict, plan_digest: str, lr: float,
               weight_decay: float, grad_clip: float, doc: str | None) -> int:
    """train.py's main: its exit status (0, or 2 after a user error, printed once for all ranks by
    launch/torchrun.sh; bad arguments exit with status 2 while parsed)."""
    script = TrainScript(Path(here), model_file, planned_for, plan_digest, lr, weight_decay, grad_clip, doc)
    args = parse_script_arguments(script)
    try:
        # the process group around run_training; closed once it has returned (runtime/launch/distributed.py says why)
        run_distributed(lambda ctx: run_training(args, ctx, script))
    except ZplanError as error:  # a mismatch or bad input: say what and how to fix it, no traceback, exit status 2
        return report_error(str(error))
    return 0
