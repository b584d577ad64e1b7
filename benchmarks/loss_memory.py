"""Peak bytes per logit of the runtime's losses, measured exactly, against the planner's budget.

    .venv/bin/python benchmarks/loss_memory.py [--json] [--shapes 1x2048x32000 2x1024x128256] [--real] [--tp 1 2 4]

What is measured: the logits are the head's output, a (B, T, V) tensor in the compute dtype (fp32, or bf16 /
fp16 as autocast and FSDP2's MixedPrecisionPolicy make it) made by a matmul, as the runtime makes them; then

    loss = LOSS(hidden @ W.t(), ids); loss.backward()

runs, for two losses:
- default: model.model_file.next_token_loss, the runtime's default, model/cross_entropy.py's in-place cross-entropy
  on the whole flattened logits (the gradient written over them a chunk at a time): the logits' own storage and one
  chunk's fp32 temporaries; the planner's planner.cost.memory_activations.logits_loss_bytes of a model without its
  own loss (ModelNumbers.default_loss);
- upcast: F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ...), the usual way (a model file's own loss, context
  parallel's): at the backward's peak three fp32 tensors of (B, T-1, V) live (the upcast, the log-softmax output's
  gradient, its input's), the logits themselves dropped (nothing holds them once the loss is computed: the head's
  backward needs its input, not its output); the planner's LOSS_BYTES_PER_LOGIT.
The number is the peak, over every aten op of that forward and backward, of the bytes of all live storages, divided
by B*T*V.

--tp N (N > 1): the vocabulary split over N tensor-parallel ranks (plan.parallel.vocab_parallel,
runtime/parallel/vocab_parallel.py), rank 0 of a fake process group of N (the dry run's, runtime/dryrun/fake_world.py:
each collective returns at once): the head's logits are a DTensor sharded on the vocabulary, (B, T, V/N) on a rank,
and the losses are the runtime's for them (vocab_parallel_loss): the default one model/cross_entropy.py's
vocab_parallel_cross_entropy (its gradient in a buffer beside the logits), the upcast one F.cross_entropy under torch's
loss_parallel. Counted by the dry run's meter (runtime/dryrun/live_memory.py: a DTensor's local ops), divided by the
logits a rank holds, B*T*ceil(V/N). The planner's number is logits_loss_bytes of a candidate with that tp.

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
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from zplan.model.model_file import next_token_loss  # noqa: E402
from zplan.planner.cost.inputs import Candidates, ModelNumbers  # noqa: E402
from zplan.planner.cost.memory import logits_loss_bytes  # noqa: E402
from zplan.runtime.dryrun.fake_world import fake_tensors, fake_world  # noqa: E402
from zplan.runtime.dryrun.live_memory import LiveMemory  # noqa: E402
from zplan.runtime.parallel.mesh import build_mesh  # noqa: E402
from zplan.runtime.parallel.vocab_parallel import loss_parallel_scope, split_vocabulary, vocab_parallel_loss  # noqa: E402

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


def upcast_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on an fp32 upcast of the shifted logits, the usual way (module docstring)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


LOSSES = {"default": next_token_loss, "upcast": upcast_loss}


def loss_peak_bytes(batch: int, seq_len: int, vocab: int, precision: str, fake: bool = True,
                    loss: str = "default", tp: int = 1) -> int:
    """Peak live bytes of `LOSSES[loss](logits, ids); loss.backward()` with (B, T, V) logits in `precision`,
    the logits and their gradient included, the token ids excluded; tp > 1: on a rank of a vocabulary split over tp
    (split_loss_peak_bytes, fake tensors)."""
    if tp > 1:
        return split_loss_peak_bytes(batch, seq_len, vocab, precision, loss, tp)
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
            value = LOSSES[loss](hidden @ weight.t(), ids)  # the logits (B, T, V) are made in here
            value.backward()
    return tracker.peak_bytes


class _Tables(nn.Module):
    """The token embedding and the head a vocabulary split takes (runtime/parallel/vocab_parallel.py), no blocks."""

    def __init__(self, vocab: int, dtype: torch.dtype):
        super().__init__()
        self.wte = nn.Embedding(vocab, HEAD_WIDTH, dtype=dtype)
        self.blocks = nn.ModuleList()
        self.lm_head = nn.Linear(HEAD_WIDTH, vocab, bias=False, dtype=dtype)


def split_loss_peak_bytes(batch: int, seq_len: int, vocab: int, precision: str, loss: str, tp: int) -> int:
    """Peak live bytes on rank 0 of `tp` of the split head's logits (B, T, V/tp) and the runtime's loss on them,
    forward and backward (module docstring: --tp)."""
    dtype = DTYPES[precision]
    with fake_world(rank=0, world_size=tp):
        mesh = build_mesh(pp=1, dp=1, tp=tp, device_type="cpu")
        with fake_tensors():
            tables = _Tables(vocab, dtype)
            split_vocabulary(tables, mesh["tp"], "blocks", vocab)
            hidden = torch.zeros(batch, seq_len, HEAD_WIDTH, dtype=dtype, requires_grad=True)
            ids = torch.zeros(batch, seq_len, dtype=torch.long)  # (B, T)
            meter = LiveMemory()
            meter.phase = "forward"
            with meter, loss_parallel_scope(tables):
                value = vocab_parallel_loss(LOSSES[loss])(tables.lm_head(hidden), ids)  # logits (B, T, V) DTensor
                value.backward()
    return meter.peak_bytes


def local_logits(batch: int, seq_len: int, vocab: int, tp: int = 1) -> int:
    """The logits rank 0 holds: B*T*ceil(V/tp) (torch.chunk's split of the vocabulary)."""
    return batch * seq_len * -(-vocab // tp)


def bytes_per_logit(batch: int, seq_len: int, vocab: int, precision: str, fake: bool = True,
                    loss: str = "default", tp: int = 1) -> float:
    return loss_peak_bytes(batch, seq_len, vocab, precision, fake, loss, tp) / local_logits(batch, seq_len, vocab, tp)


def planner_bytes_per_logit(batch: int, seq_len: int, vocab: int, precision: str, loss: str = "default",
                            tp: int = 1) -> float:
    """What the planner budgets a logit (a rank's, tp > 1: its vocabulary split) for that loss: logits_loss_bytes of
    a candidate (tp, cp 1) of a model with the runtime's default loss, or with its own (the upcast one)."""
    model = ModelNumbers(num_blocks=1, hidden=HEAD_WIDTH, heads=1, ffn_hidden=HEAD_WIDTH, vocab=vocab,
                         seq_len=seq_len, params=0.0, embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0,
                         head_fwd_flops=0.0, block_params=0.0, block_fwd_flops=0.0, block_act_bytes=0.0,
                         embed_act_bytes=0.0, head_act_bytes=0.0, default_loss=loss == "default",
                         vocab_splittable=tp > 1)
    cand = Candidates.single(tp=tp, pp=1, dp=1, micro_batch=batch, zero=0, recompute=0, sp=0, interleave=1, offload=0)
    return float(logits_loss_bytes(model, cand, precision)[0]) / local_logits(batch, seq_len, vocab, tp)


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
    parser.add_argument("--tp", nargs="+", type=int, default=[1],
                        help="tensor-parallel sizes; > 1: the vocabulary split over them (fake tensors)")
    args = parser.parse_args(argv)

    rows = []
    for tp in args.tp:
        for batch, seq_len, vocab in args.shapes:
            for loss in LOSSES:
                for precision in DTYPES:
                    measured = bytes_per_logit(batch, seq_len, vocab, precision, not args.real, loss, tp)
                    planned = planner_bytes_per_logit(batch, seq_len, vocab, precision, loss, tp)
                    rows.append(dict(tp=tp, batch=batch, seq_len=seq_len, vocab=vocab, loss=loss, precision=precision,
                                     bytes_per_logit=measured, planner_bytes_per_logit=planned,
                                     planner_over_measured=planned / measured))
    result: dict = {"tensors": "real" if args.real and args.tp == [1] else "fake", "rows": rows}
    for tp in args.tp:
        for loss in LOSSES:
            for precision in DTYPES:  # the largest over the shapes: what a budget has to cover
                mine = [r for r in rows if r["precision"] == precision and r["loss"] == loss and r["tp"] == tp]
                name = loss if tp == 1 else f"{loss}_tp{tp}"
                result[f"{name}_bytes_per_logit_{precision}"] = max(r["bytes_per_logit"] for r in mine)
                result[f"{name}_planner_over_measured_{precision}"] = [min(r["planner_over_measured"] for r in mine),
                                                                       max(r["planner_over_measured"] for r in mine)]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{'tp':>2} {'B':>3} {'T':>5} {'V':>7} {'loss':>7} {'precision':>9} {'measured B/logit':>17} "
              f"{'planner':>8} {'ratio':>6}")
        for r in rows:
            shape = f"{r['tp']:>2} {r['batch']:>3} {r['seq_len']:>5} {r['vocab']:>7} {r['loss']:>7} {r['precision']:>9}"
            print(f"{shape} {r['bytes_per_logit']:>17.4f} {r['planner_bytes_per_logit']:>8.2f} "
                  f"{r['planner_over_measured']:>6.3f}")
    return result


if __name__ == "__main__":
    main()
