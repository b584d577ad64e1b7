"""Peak bytes per logit of the runtime's default loss, measured exactly, against the planner's budget.

    .venv/bin/python benchmarks/loss_memory.py [--json] [--shapes 1x2048x32000 2x1024x128256] [--real]

What is measured: the logits are the head's output, a (B, T, V) tensor in the compute dtype (fp32, or bf16 /
fp16 as autocast and FSDP2's MixedPrecisionPolicy make it) made by a matmul, as the runtime makes them; then

    loss = next_token_loss(hidden @ W.t(), ids); loss.backward()

runs (model.model_file.next_token_loss, the runtime's default loss: cross-entropy on
logits[:, :-1].flatten(0, 1).float()). The number is the peak, over every aten op of that forward and
backward, of the bytes of all live storages: the logits while the loss is computed, everything the loss
allocates (the fp32 upcast, the log-softmax output, its gradient, the gradient of its input, the logits'
gradient); nothing holds the logits after the loss is computed (the train loop does not, and the head's
backward needs its input, not its output), so at the backward's peak three fp32 tensors of (B, T-1, V) live.
Divided by B*T*V, it is the bytes per logit
that planner/cost/memory.py budgets on the last pipeline stage (LOSS_BYTES_PER_LOGIT).

How: a TorchDispatchMode sees the output of every aten op, forward and backward, and counts each new
storage's nbytes until the storage is freed (a weakref finalizer), so the count is exact, without an
allocator's rounding or caching. By default the tensors are fake (FakeTensorMode: no memory is allocated,
so vocabularies of 128k run in a second); --real runs the same on real CPU tensors (needs the memory).
The ratio column is the planner's budget over the measurement (1.00: the planner budgets what runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import weakref
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zplan.model.model_file import next_token_loss  # noqa: E402
from zplan.planner.cost.memory import LOSS_BYTES_PER_LOGIT  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_WIDTH = 8  # hidden width of the stand-in head
DEFAULT_SHAPES = ((1, 2048, 32000), (2, 1024, 128256), (4, 512, 50304))  # (B, T, V), B*T = 2048


class LiveStorageBytes(TorchDispatchMode):
    """Bytes of the live storages that aten ops produced (or that `track` was given), and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}  # id of the storage -> its nbytes
        self.current_bytes = 0
        self.peak_bytes = 0

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)  # torch keeps one Python object per live storage, so the id is stable while it lives
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current_bytes -= self._live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out


def loss_peak_bytes(batch: int, seq_len: int, vocab: int, precision: str, fake: bool = True) -> int:
    """Peak live bytes of `next_token_loss(logits, ids); loss.backward()` with (B, T, V) logits in `precision`,
    the logits and their gradient included, the token ids excluded."""
    dtype = DTYPES[precision]
    with FakeTensorMode() if fake else contextlib.nullcontext():
        # the head as the runtime runs it: logits = hidden @ W^T, a non-leaf that nothing keeps once the loss is
        # computed (the matmul's backward needs its inputs, not its output); HEAD_WIDTH small enough that the
        # head's own tensors and gradients are negligible beside the (B, T, V) ones
        hidden = torch.zeros(batch, seq_len, HEAD_WIDTH, dtype=dtype, requires_grad=True)
        weight = torch.zeros(vocab, HEAD_WIDTH, dtype=dtype, requires_grad=True)
        ids = torch.zeros(batch, seq_len, dtype=torch.long)  # (B, T)
        tracker = LiveStorageBytes()
        with tracker:
            loss = next_token_loss(hidden @ weight.t(), ids)  # the logits (B, T, V) are made and dropped in here
            loss.backward()
    return tracker.peak_bytes


def bytes_per_logit(batch: int, seq_len: int, vocab: int, precision: str, fake: bool = True) -> float:
    return loss_peak_bytes(batch, seq_len, vocab, precision, fake) / (batch * seq_len * vocab)


def parse_shape(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"shape {text!r}: write BxTxV, e.g. 1x2048x32000")
    return int(parts[0]), int(parts[1]), int(parts[2])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=list(DEFAULT_SHAPES), help="BxTxV ...")
    parser.add_argument("--real", action="store_true", help="real CPU tensors instead of fake ones")
    args = parser.parse_args(argv)

    rows = []
    for batch, seq_len, vocab in args.shapes:
        for precision in DTYPES:
            measured = bytes_per_logit(batch, seq_len, vocab, precision, fake=not args.real)
            rows.append(dict(batch=batch, seq_len=seq_len, vocab=vocab, precision=precision,
                             bytes_per_logit=measured, planner_bytes_per_logit=LOSS_BYTES_PER_LOGIT[precision],
                             planner_over_measured=LOSS_BYTES_PER_LOGIT[precision] / measured))
    result: dict = {"tensors": "real" if args.real else "fake", "rows": rows}
    for precision in DTYPES:  # the largest over the shapes: what a budget has to cover
        result[f"bytes_per_logit_{precision}"] = max(r["bytes_per_logit"] for r in rows if r["precision"] == precision)
        result[f"planner_bytes_per_logit_{precision}"] = LOSS_BYTES_PER_LOGIT[precision]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{'B':>3} {'T':>5} {'V':>7} {'precision':>9} {'measured B/logit':>17} {'planner':>8} {'ratio':>6}")
        for r in rows:
            shape = f"{r['batch']:>3} {r['seq_len']:>5} {r['vocab']:>7} {r['precision']:>9}"
            print(f"{shape} {r['bytes_per_logit']:>17.4f} {r['planner_bytes_per_logit']:>8.2f} "
                  f"{r['planner_over_measured']:>6.3f}")
    return result


if __name__ == "__main__":
    main()
