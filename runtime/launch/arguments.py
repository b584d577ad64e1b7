"""The emitted train.py's command line (train_argument_parser), its values checked when it is parsed: before the process
group, the model or any file, each value against its range, and the few values that only make sense together.

    args = parse_train_arguments(doc=__doc__, lr=LR)   # train.py's docstring as --help's text, its LR the default

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
from zplan.runtime.launch.torchrun import ArgumentParser

# Optimizer steps at most: far beyond any run (GPT-3 175B trained for about 94,000 steps), and what --keep,
# --checkpoint-every and --warmup-steps count up to as well.
MAX_STEPS = 10**9
# The largest seed that is its own: torch's CPU generator (a Mersenne Twister, which makes the weights and the sampling
# generators) keeps the low 32 bits of a seed, so 2^32 + s and -1 draw what s and 2^32 - 1 draw.
MAX_SEED = 2**32 - 1
# The peak learning rate at most: AdamW moves each weight by about the learning rate per step, so beyond 1 (weights
# initialised at about 0.02) a step undoes the model; NaN or infinite turns every weight into NaN at once.
MAX_LR = 1.0
# --eval-batches: global batches per evaluation; its default is small (evaluation runs beside training), its
# largest far beyond a validation set's use
DEFAULT_EVAL_BATCHES = 4
MAX_EVAL_BATCHES = 10**6


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


# --save-weights' formats by suffix: safetensors, or a torch.save dict {name: tensor} (runtime.checkpoint.weights_file)
WEIGHTS_SUFFIXES = (".safetensors", ".pt", ".bin")


def weights_file_name(text: str) -> str:
    """An argparse type: --save-weights' FILE, a path ending in one of WEIGHTS_SUFFIXES."""
    path_name(text)
    if not text.endswith(WEIGHTS_SUFFIXES):
        raise argparse.ArgumentTypeError(f"must end in .safetensors (safetensors, which transformers and "
                                         f"safetensors.torch.load_file read) or .pt / .bin (a torch.save state dict) "
                                         f"(got {text!r})")
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
    if args.val_data is None and (args.eval_every or args.eval_batches != DEFAULT_EVAL_BATCHES):
        return "--eval-every and --eval-batches need --val-data PATH (the data to evaluate on)"
    if args.tokenizer is not None and args.data is None and args.val_data is None:
        return "--tokenizer needs --data or --val-data (a text, .jsonl or datasets path to tokenize)"
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


def train_argument_parser(doc: str | None, lr: float) -> ArgumentParser:
    """train.py's options; `doc` (its docstring) heads --help, `lr` (its LR) is --lr's default."""
    parser = ArgumentParser(  # argparse; its errors are printed once through launch/torchrun.sh, exit status 2
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=integer(1, MAX_STEPS), default=20, help="optimizer steps (default 20)")
    parser.add_argument("--log-json", type=path_name, metavar="FILE", help="write one JSON line per step (rank 0)")
    parser.add_argument("--tensorboard", type=path_name, metavar="DIR",
                        help="write the per-step scalars (loss, lr, grad norm, tokens/s, MFU, memory) as TensorBoard "
                             "event files in DIR (rank 0; needs `pip install tensorboard`)")
    parser.add_argument("--lr", type=learning_rate, default=lr, help=f"peak learning rate, 0 < LR <= 1 (default {lr})")
    parser.add_argument("--warmup-steps", type=integer(0, MAX_STEPS),
                        help="linear warmup steps, at most --steps (default: steps // 10, >= 1)")
    parser.add_argument("--seed", type=integer(0, MAX_SEED), default=0,
                        help="weights and synthetic data seed, 0 to 2^32 - 1 (default 0)")
    parser.add_argument("--model", type=path_name, metavar="PATH", help="model file (default: MODEL_FILE)")
    parser.add_argument("--save-weights", type=weights_file_name, metavar="FILE",
                        help="save the trained weights as one file: FILE.safetensors, or FILE.pt a torch.save dict")
    parser.add_argument("--init-from", type=path_name, metavar="PATH",
                        help="start from these weights: a .safetensors file, a Hugging Face folder (sharded with "
                             "model.safetensors.index.json, or model.safetensors) or a zplan step-N checkpoint (its "
                             "weights only); 'none': from the model's initialisation (default: the weights of the "
                             "Hugging Face folder the plan was compiled from, else none)")
    parser.add_argument("--checkpoint-dir", type=path_name, metavar="DIR",
                        help="write checkpoints (step-N folders) here")
    parser.add_argument("--checkpoint-every", type=integer(0, MAX_STEPS), default=0, metavar="N",
                        help="checkpoint every N steps (default 0: only after the last step)")
    parser.add_argument("--keep", type=integer(1, MAX_STEPS), metavar="K",
                        help="keep the last K checkpoints (default 3)")
    parser.add_argument("--resume", type=resume_value, nargs="?", const="latest", metavar="CKPT",
                        help="go on from checkpoint CKPT, or without CKPT from the newest complete one in "
                             "--checkpoint-dir (from step 0 when there is none yet); 'latest-valid': the newest "
                             "whose files match their checksums, passing over damaged and unverified ones (each "
                             "file is checked before a resume either way)")
    parser.add_argument("--allow-unverified", action="store_true",
                        help="resume from a checkpoint that has no MANIFEST.json (its files cannot be checked: "
                             "damage goes unnoticed); --resume latest-valid never takes one")
    parser.add_argument("--allow-nonfinite-loss", action="store_true",
                        help="go on after a NaN or infinite loss (default: stop with exit status 2, the last "
                             "checkpoint kept); no checkpoint is written of a step whose loss is not finite")
    parser.add_argument("--nvme-path", type=path_name, metavar="DIR",
                        help="folder on a local NVMe drive for the swap files of a plan that offloads to NVMe (one "
                             "subfolder per rank, removed at exit); it must hold 8 bytes per parameter a rank updates")
    parser.add_argument("--onebit-warmup-steps", type=integer(1, MAX_STEPS), metavar="N",
                        help="with 1-bit Adam: exact AdamW steps before it freezes Adam's variance and compresses "
                             "(default: the planner's, or 30%% of --steps when that is fewer)")
    # your data (runtime/data, docs/runtime.md "Your data")
    parser.add_argument("--data", type=path_name, metavar="PATH",
                        help="train on this data instead of synthetic tokens: a token file (tokens.bin with its "
                             "tokens.bin.json, from `zplan data prepare`), or with --tokenizer a text file (a document "
                             "per line), a .jsonl file (a \"text\" field per line) or a datasets folder (save_to_disk)")
    parser.add_argument("--tokenizer", type=path_name, metavar="DIR",
                        help="the Hugging Face tokenizer folder (save_pretrained's) for text --data / --val-data")
    parser.add_argument("--val-data", type=path_name, metavar="PATH",
                        help="validation data (as --data): val_loss and val_ppl logged every --eval-every steps and "
                             "after the last")
    parser.add_argument("--eval-every", type=integer(0, MAX_STEPS), default=0, metavar="N",
                        help="evaluate --val-data every N steps (default 0: after the last step only)")
    parser.add_argument("--eval-batches", type=integer(1, MAX_EVAL_BATCHES), default=DEFAULT_EVAL_BATCHES,
                        metavar="N", help=f"global batches of --val-data per evaluation, the same ones each time "
                                          f"(default {DEFAULT_EVAL_BATCHES})")
    parser.add_argument("--allow-other-data", action="store_true",
                        help="resume on other data (file, seed or sequence length) than the checkpoint recorded: "
                             "this run's data then starts from its first sequence (default: refused)")
    return parser


def parse_train_arguments(doc: str | None, lr: float, argv: list[str] | None = None) -> argparse.Namespace:
    """train.py's arguments (`argv`, default sys.argv[1:]), each checked, then taken together
    (train_arguments_problem); a problem exits with status 2 through the parser's error."""
    parser = train_argument_parser(doc, lr)
    args = parser.parse_args(argv)
    problem = train_arguments_problem(args)
    if problem:
        parser.error(problem)
    return args
