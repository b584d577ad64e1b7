"""The vocabulary split over tensor parallel (Megatron's VocabParallelEmbedding and parallel cross-entropy,
Shoeybi et al. 2019, section 3), where the plan says so (plan.json parallel.vocab_parallel).

    problem = vocabulary_problem(model, block_prefix, vocab)   # compile time, on the meta model: None, or why not
    split_vocabulary(model, tp_mesh, block_prefix, vocab)      # runtime.parallel.tensor_parallel calls it
    loss_fn = vocab_parallel_loss(tp_mesh, vocab)               # runtime.plan.apply's loss for such a plan

The token embedding (the one nn.Embedding of `vocab` rows outside the blocks) and the output head (the one nn.Linear
of `vocab` outputs outside them) hold V/tp rows each per tp rank (DTensor Shard(0); torch.chunk's split: ceil(V/tp)
rows a rank, the last ones fewer when tp does not divide V). The embedding looks its rows up (an id another rank
holds reads zeros) and its (B, T, h) output is all-reduced over tp, a plain tensor again for the rest of the model;
the head takes its whole (B, T, h) input (its gradient all-reduced in the backward) and gives this rank's logits,
(B, T, V/tp), a plain tensor: they are never gathered. A tied head shares the embedding's sharded table.
The loss is the runtime's next-token loss on those logits, model/cross_entropy.py's vocab_parallel_cross_entropy (the
maxima, the sums of exponentials and the targets' logits all-reduced, the gradient written over the logits): a model
file with its own loss_fn sees whole logits, so its vocabulary is not split (schemas/capability.py, trait own_loss).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from zplan.errors import PlanMismatchError
from zplan.model.cross_entropy import shifted_targets, vocab_parallel_cross_entropy
from zplan.model.model_file import logits_of


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
    parallelize_module(head, tp_mesh, ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1)))
    if tied:  # one table: the head reads the embedding's sharded rows (both Shard(0) of a (V, h) weight)
        head.weight = embedding.weight


def vocab_start(vocab: int, tp: int, rank: int) -> int:
    """The first vocabulary row of tp rank `rank` under Shard(0) (torch.chunk: ceil(V/tp) rows a rank)."""
    return min(vocab, rank * math.ceil(vocab / tp))


def vocab_parallel_next_token_loss(outputs: Any, batch: Any, *, group, start: int) -> torch.Tensor:
    """model.model_file.next_token_loss on this rank's logits (B, T, V/tp) of a split vocabulary."""
    logits = logits_of(outputs)
    tokens = batch["input_ids"] if isinstance(batch, dict) else batch  # (B, T)
    return vocab_parallel_cross_entropy(logits.flatten(0, 1), shifted_targets(tokens), group, start)


def vocab_parallel_loss(tp_mesh: DeviceMesh, vocab: int):
    """The loss of a plan that splits the vocabulary, for this rank of `tp_mesh`."""
    return partial(vocab_parallel_next_token_loss, group=tp_mesh.get_group(),
                   start=vocab_start(vocab, tp_mesh.size(), tp_mesh.get_local_rank()))
