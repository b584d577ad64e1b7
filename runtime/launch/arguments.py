"""The values of the emitted train.py's command line, checked when it is parsed: before the process group, the model
or any file, each value against its range, and the few values that only make sense together.

    parser.add_argument("--steps", type=integer(1, MAX_STEPS), default=20)
    parser.add_argument("--lr", type=learning_rate, default=LR)
    parser.add_argument("--log-json", type=path_name)
    problem = train_arguments_problem(args)   # after parse_args: --warmup-steps within --steps, ...
    if problem: parser.error(problem)

A type here raises argparse.ArgumentTypeError, which argparse reports as `argument --steps: must be ... (got '0')`
and runtime.launch.torchrun.ArgumentParser prints once (through the launcher too) with exit status 2, no traceback. A
value that argparse would take but the run would read with another meaning is refused the same way: NaN or an infinite
learning rate (NaN weights from the first step), a seed torch's CPU generator cannot tell from another one (it keeps
a seed's low 32 bits: seed 2^32 is seed 0, seed -1 is seed 2^32 - 1), an empty path (read as "not given", or as
the current folder), --checkpoint-every or --keep without --checkpoint-dir (no checkpoint would be written).
generate.py and serve.py check theirs in runtime.inference.cli (check_generate_arguments, check_serve_arguments).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from zplan.runtime.checkpoint.folders import LATEST, LATEST_VALID

# Optimizer steps at most: far beyond any run (GPT-3 175B trained for about 94,000 steps), and what --keep,
# --checkpoint-every and --warmup-steps count up to as well.
MAX_STEPS = 10**9
# The largest seed that is its own: torch's CPU generator (a Mersenne Twister, which makes the weights and the sampling
# generators) keeps the low 32 bits of a seed, so 2^32 + s and -1 draw what s and 2^32 - 1 draw.
MAX_SEED = 2**32 - 1
# The peak learning rate at most: AdamW moves each weight by about the learning rate per step, so beyond 1 (weights
# initialised at about 0.02) a step undoes the model; NaN or infinite turns every weight into NaN at once.
MAX_LR = 1.0


def integer(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be a whole number from {low:,} to {high:,} (got {text!r})")
        return value

    parse.__name__ = "integer"
    return parse


def learning_rate(text: str) -> float:
    """An argparse type: the peak learning rate, a finite number more than 0 and at most MAX_LR."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= MAX_LR:  # NaN is never in range
        raise argparse.ArgumentTypeError(f"must be a number more than 0 and at most {MAX_LR:g} (got {text!r})")
    return value


def path_name(text: str) -> str:
    """An argparse type: a path, not the empty string (which would mean "not given", or the current folder)."""
    if not text:
        raise argparse.ArgumentTypeError("must be a path, not an empty string (got '')")
    return text


def resume_value(text: str) -> str:
    """An argparse type: --resume's CKPT, a checkpoint path or 'latest' / 'latest-valid', not the empty string (which
    would start from step 0)."""
    if not text:
        raise argparse.ArgumentTypeError(f"must be a checkpoint path, {LATEST} or {LATEST_VALID}, not an empty string "
                                         "(got '')")
    return text


def train_arguments_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with train.py's values taken together (a message naming the options), or None."""
    if args.warmup_steps is not None and args.warmup_steps > args.steps:
        return (f"--warmup-steps {args.warmup_steps} is more than --steps {args.steps}: the learning rate would never "
                f"reach --lr; give 0 to {args.steps} warm-up steps")
    if args.checkpoint_dir is None:
        if args.checkpoint_every:
            return (f"--checkpoint-every {args.checkpoint_every} needs --checkpoint-dir DIR: without it no checkpoint "
                    "is written")
        if args.keep is not None:
            return f"--keep {args.keep} needs --checkpoint-dir DIR: without it no checkpoint is written"
        if args.resume in (LATEST, LATEST_VALID):
            word = "" if args.resume == LATEST else f" {LATEST_VALID}"
            return f"--resume{word} without a checkpoint path needs --checkpoint-dir DIR (the folder to resume from)"
    return None
