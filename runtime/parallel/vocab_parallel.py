"""The vocabulary split over tensor parallel (Megatron's VocabParallelEmbedding and parallel cross-entropy,
Shoeybi et al. 2019, section 3), where the plan says so (plan.json parallel.vocab_parallel).

    problem = vocabulary_problem(model, block_prefix, vocab)   # compile time, on the meta model: None, or why not
    split_vocabulary(model, tp_mesh, block_prefix, vocab)      # runtime.parallel.tensor_parallel calls it
    loss_fn = vocab_parallel_loss(model_file.loss_fn)           # runtime.plan.apply's loss for such a plan
    with loss_parallel_scope(model):                            # around a micro-batch's forward, loss and backward
        loss_fn(model(batch), batch).backward()

The token embedding (the one nn.Embedding of `vocab` rows outside the blocks) and the output head (the one nn.Linear
of `vocab` outputs outside them) hold V/tp rows each per tp rank (DTensor Shard(0); torch.chunk's split: ceil(V/tp)
rows a rank, the last ones fewer when tp does not divide V, e.g. GPT-2's 50257 at tp 2: 25129 and 25128). A tied head
shares the embedding's sharded table: one DTensor parameter.
  - embedding (RowwiseParallel): each rank looks up the ids it holds (another rank's id reads zeros: DTensor's masked
    lookup), the (B, T, h) output all-reduced over tp in the forward and handed on as a plain tensor, as without the
    split (sequence parallel cuts it at the first block: runtime/parallel/tensor_parallel.py); no collective in the
    backward;
  - head (ColwiseParallel): its whole (B, T, h) input, whose gradient is all-reduced over tp in the backward; its
    output is this rank's logits, a DTensor sharded on the vocabulary, (B, T, V/tp) local, never gathered.

The loss on those logits (vocab_parallel_loss), the same on every tp rank, returned as a plain tensor:
  - the runtime's default next-token loss (model.model_file.next_token_loss) is model/cross_entropy.py's
    vocab_parallel_cross_entropy on the local logits: each row's maximum, sum of exponentials and target logit
    all-reduced over tp, (B*T,) fp32 each, in the forward; the gradient is made with the loss, in a buffer of the local
    logits' size (autograd forbids writing over the view to_local() makes), and the backward has no collective;
  - any other loss (a model file's loss_fn, F.cross_entropy on outputs.logits.reshape(-1, V); a Hugging Face model's
    outputs.loss, which transformers' ForCausalLMLoss computes in the forward from the batch's labels) runs on the
    DTensor logits under torch's loss_parallel (torch/distributed/tensor/parallel/loss.py):
    log_softmax and nll_loss of a DTensor sharded on the class dim all-reduce the same three (B*T,) fp32 vectors in
    the forward, and their backward is local. Its handlers must be registered over the forward (where a Hugging Face
    model computes its loss) and the backward: loss_parallel_scope, which the training step, the pipeline's step, the
    validation loss and the dry run hold around them.
Peak bytes a logit this rank holds (B*T*ceil(V/tp)) of the loss's forward and backward, the logits and their
gradient included, on fake tensors (benchmarks/loss_memory.py --tp 2 4): the default loss twice the logits' dtype
(the logits and the gradient buffer) plus fp32 chunks of model/cross_entropy.py CHUNK_ELEMENTS logits, one in fp32 and
two in 16-bit: 8.5 (fp32) and 5.0 (bf16) at (B, T, V) = (2, 1024, 128256), tp 2; 12.0 at (1, 2048, 32000), tp 4, where
a chunk is all the logits. Under loss_parallel 16.0 in fp32 and bf16 alike (the fp32 log-softmax and its input, then
the backward's zeros, exponentials and their sum), and the logits' own 4 or 2 more where something keeps them through
the loss (a pipeline's last stage: the schedule holds its output until the backward).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from zplan.errors import PlanMismatchError
from zplan.model.cross_entropy import shifted_targets, vocab_parallel_cross_entropy
from zplan.model.model_file import logits_of, next_token_loss

_SPLIT_HEAD = "_zplan_vocab_split"  # set on a split head: loss_parallel_scope looks for it


def _outside_blocks(model: nn.Module, block_prefix: str):
    for name, module in model.named_modules():
        if name != block_prefix and not name.startswith(block_prefix + "."):
            yield name, module


def _declared(model: nn.Module, getter: str) -> list[str]:
    """The path of the module a Hugging Face model names as its input or output embeddings ([] if none)."""
    try:
        module = getattr(model, getter)()
    except (AttributeError, NotImplementedError):
        return []
    return [name for name, m in model.named_modules() if m is module][:1]


def vocabulary_modules(model: nn.Module, block_prefix: str, vocab: int) -> tuple[str, str] | str:
    """(embedding path, head path) of the modules the split takes, or why the model has no such pair: those a Hugging
    Face model declares (get_input_embeddings, get_output_embeddings), else the one nn.Embedding of `vocab` rows and
    the one nn.Linear of `vocab` outputs outside the blocks."""
    outside = dict(_outside_blocks(model, block_prefix))
    embeddings = _declared(model, "get_input_embeddings") or [
        name for name, m in outside.items() if isinstance(m, nn.Embedding) and m.num_embeddings == vocab]
    heads = _declared(model, "get_output_embeddings") or [
        name for name, m in outside.items() if isinstance(m, nn.Linear) and m.out_features == vocab]
    embeddings = [n for n in embeddings
                  if isinstance(outside.get(n), nn.Embedding) and outside[n].num_embeddings == vocab]
    heads = [n for n in heads if isinstance(outside.get(n), nn.Linear) and outside[n].out_features == vocab]
    if len(embeddings) != 1 or len(heads) != 1:
        return (f"{len(embeddings)} nn.Embedding of {vocab} rows and {len(heads)} nn.Linear of {vocab} outputs "
                "outside the blocks (the split takes one of each)")
    if model.get_submodule(embeddings[0]).padding_idx is not None:  # its row's gradient zeroed: a rank's local row
        return f"{embeddings[0]} has a padding_idx, whose zeroed gradient row the split would misplace"
    return embeddings[0], heads[0]


def vocabulary_problem(model: nn.Module, block_prefix: str, vocab: int) -> str | None:
    """Why the runtime cannot split this model's vocabulary (None: it can); meta-safe, for compile time."""
    if vocab <= 0:
        return "the model has no vocabulary"
    found = vocabulary_modules(model, block_prefix, vocab)
    return found if isinstance(found, str) else None


def split_vocabulary(model: nn.Module, tp_mesh: DeviceMesh, block_prefix: str, vocab: int) -> None:
    """Split the token embedding and the output head by vocabulary rows over `tp_mesh` (module docstring)."""
    found = vocabulary_modules(model, block_prefix, vocab)
    if isinstance(found, str):
        raise PlanMismatchError(f"the plan splits the vocabulary over tp (parallel.vocab_parallel), and the model has "
                                f"{found}. Recompile the plan for this model.")
    embedding_path, head_path = found
    embedding, head = model.get_submodule(embedding_path), model.get_submodule(head_path)
    tied = head.weight is embedding.weight
    parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    parallelize_module(head, tp_mesh, ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                      use_local_output=False))
    if tied:  # one table: the head reads the embedding's sharded rows (both Shard(0) of a (V, h) weight)
        head.weight = embedding.weight
    setattr(head, _SPLIT_HEAD, True)


def splits_vocabulary(model: nn.Module) -> bool:
    """Whether `model` (or this pipeline rank's part of it) holds a head split_vocabulary split."""
    return any(getattr(module, _SPLIT_HEAD, False) for module in model.modules())


# ---- the loss --------------------------------------------------------------------------------------------------


def vocab_start(vocab: int, tp: int, rank: int) -> int:
    """The first vocabulary row of tp rank `rank` under Shard(0) (torch.chunk: ceil(V/tp) rows a rank)."""
    return min(vocab, rank * math.ceil(vocab / tp))


def _split_logits(outputs: Any) -> DTensor:
    """The logits in `outputs`: the split head's (B, T, V) DTensor, sharded on V over the tp mesh."""
    logits = logits_of(outputs)
    if not (isinstance(logits, DTensor) and logits.placements == (Shard(logits.ndim - 1),)):
        raise PlanMismatchError(f"the plan splits the vocabulary over tp, and the model's logits are "
                                f"{type(logits).__name__} {getattr(logits, 'placements', '')}, not the split head's "
                                "(B, T, V) sharded on V: the head must be the model's last step. Recompile the plan.")
    return logits


def split_next_token_loss(outputs: Any, batch: Any) -> torch.Tensor:
    """model.model_file.next_token_loss of logits split over the vocabulary (module docstring), a plain scalar."""
    logits = _split_logits(outputs)  # (B, T, V): this rank's (B, T, V/tp)
    mesh = logits.device_mesh
    tokens = batch["input_ids"] if isinstance(batch, dict) else batch  # (B, T)
    start = vocab_start(logits.shape[-1], mesh.size(), mesh.get_local_rank())
    return vocab_parallel_cross_entropy(logits.to_local().flatten(0, 1), shifted_targets(tokens), mesh.get_group(),
                                        start)


def _plain_loss(loss_fn: Callable, outputs: Any, batch: Any) -> torch.Tensor:
    loss = loss_fn(outputs, batch)
    return loss.full_tensor() if isinstance(loss, DTensor) else loss  # Replicate over tp: its local value


def vocab_parallel_loss(loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    """The loss of a plan that splits the vocabulary, from the loss it would have otherwise (the model file's, context
    parallel's): the default next-token loss computed on the split logits, any other under loss_parallel_scope; a
    plain tensor either way (module docstring)."""
    return split_next_token_loss if loss_fn is next_token_loss else partial(_plain_loss, loss_fn)


class _LossParallel:
    """torch's loss_parallel() entered once however scopes nest: its exit unregisters its handlers, which an inner
    scope's exit must not do under an outer one."""

    depth = 0
    context: contextlib.AbstractContextManager | None = None


@contextlib.contextmanager
def loss_parallel_scope(model: nn.Module) -> Iterator[None]:
    """torch's loss_parallel() where `model` holds a split head (splits_vocabulary), else nothing: to hold around a
    forward, its loss and its backward (module docstring)."""
    if not splits_vocabulary(model):
        yield
        return
    if _LossParallel.depth == 0:
        _LossParallel.context = loss_parallel()
        _LossParallel.context.__enter__()
    _LossParallel.depth += 1
    try:
        yield
    finally:
        _LossParallel.depth -= 1
        if _LossParallel.depth == 0:
            _LossParallel.context.__exit__(None, None, None)
