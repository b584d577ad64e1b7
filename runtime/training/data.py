"""Training batches: --data (a token, text or JSON-lines file, or a saved dataset: runtime/data), the model file's
train_data hook, or synthetic tokens. --data and a train_data hook together are refused (open_run_data).

Synthetic tokens are a function of (seed, step) alone: step s's global batch of
dp_size * num_micro_batches * micro_batch sequences is the same in every run, and data-parallel
rank r takes its own contiguous slice of it. A run on N ranks therefore sees exactly the global batch
a single process sees, which is what makes runs under different plans comparable.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from zplan.runtime.data.errors import DataError
from zplan.runtime.data.source import TokenData, open_data, token_batches

# Each sequence is an arithmetic progression modulo the vocabulary, with a random start and a stride
# drawn from 1..MAX_STRIDE: the next token follows from the previous two, so a small model's loss
# falls from ln(vocab) quickly, unlike uniform noise, where nothing can be learnt.
MAX_STRIDE = 3


def synthetic_token_batch(vocab: int, seq_len: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """Step `step`'s global batch of token ids, shape (batch_size, seq_len), int64, on the CPU."""
    generator = torch.Generator().manual_seed((seed << 32) + step)
    start = torch.randint(0, vocab, (batch_size, 1), generator=generator)  # (B, 1)
    stride = torch.randint(1, MAX_STRIDE + 1, (batch_size, 1), generator=generator)  # (B, 1)
    return (start + stride * torch.arange(seq_len)) % vocab  # (B, T)


def synthetic_token_batches(
    *, vocab: int, seq_len: int, micro_batch: int, num_micro_batches: int, dp_rank: int, dp_size: int,
    seed: int,
) -> Iterator[torch.Tensor]:
    """This data-parallel rank's micro-batches, (micro_batch, seq_len) each, step after step, forever."""
    per_rank = micro_batch * num_micro_batches
    step = 0
    while True:
        # (dp_size * per_rank, T)
        global_batch = synthetic_token_batch(vocab, seq_len, dp_size * per_rank, seed, step)
        mine = global_batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        for micro in range(num_micro_batches):
            yield mine[micro * micro_batch : (micro + 1) * micro_batch]
        step += 1


def _accepted_kwargs(fn, **kwargs) -> dict:
    parameters = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in parameters}


def _rows(batch, start: int, stop: int):
    """Rows start:stop (dim 0) of a tensor, or of every tensor in a tuple, list or dict."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {k: _rows(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_rows(v, start, stop) for v in batch)
    raise TypeError(f"train_data yielded a {type(batch).__name__}; yield tensors, tuples or dicts of tensors")


def _slices_of_global_batches(global_batches, micro_batch: int, dp_rank: int) -> Iterator:
    for batch in global_batches:  # each (dp_size * micro_batch, ...)
        yield _rows(batch, dp_rank * micro_batch, (dp_rank + 1) * micro_batch)


@dataclass(frozen=True)
class RunData:
    """train.py's --data and --val-data, opened and checked (None where not given)."""

    train: TokenData | None = None
    val: TokenData | None = None


def open_run_data(model_file, *, data: str | None, val_data: str | None, tokenizer: str | None, vocab: int,
                  seq_len: int, global_batch: int, eval_batches: int) -> RunData:
    """--data and --val-data opened and checked (DataError naming the file and the fix), on every rank before any
    collective: a train_data hook beside --data, ids beyond `vocab`, fewer sequences than one global batch of
    `global_batch` (--eval-batches of them for --val-data)."""
    hook = getattr(model_file, "user_train_data", None)
    if data and hook is not None:
        raise DataError(f"--data {data} is given and the model file {getattr(model_file, 'path', '')} defines its own "
                        "train_data hook: zplan would not know which to train on. Drop --data to train on the hook, "
                        "or remove (rename) train_data in the model file to train on --data")
    loaded: dict = {}  # the tokenizer, loaded once for both
    train = open_data(data, vocab=vocab, tokenizer=tokenizer, loaded=loaded) if data else None
    val = open_data(val_data, vocab=vocab, tokenizer=tokenizer, option="--val-data", loaded=loaded) if val_data \
        else None
    for opened, option, needed in ((train, "--data", 1), (val, "--val-data", eval_batches)):
        if opened is not None:  # enough sequences (a throwaway iterator: the check only)
            token_batches(opened, seq_len=seq_len, micro_batch=global_batch, num_micro_batches=1, dp_rank=0,
                          dp_size=1, seed=0, batches_needed=needed, option=option)
    return RunData(train, val)


def make_data_iter(
    model_file, *, vocab: int, seq_len: int, micro_batch: int, num_micro_batches: int,
    dp_rank: int, dp_size: int, seed: int, data: TokenData | None = None,
) -> Iterator:
    """Micro-batches for this data-parallel rank.

    With `data` (--data: open_run_data): token ids (micro_batch, seq_len) of its packed sequences in the order of
    `seed`, step s's global batch of dp_size * num_micro_batches * micro_batch sequences sliced over the ranks as for
    synthetic data (runtime/data/batches.py: a TokenBatches, whose position checkpoints record).

    With a `train_data` hook in the model file, it is called with the keywords it accepts among
    batch_size, seq_len, rank, world_size and seed, and yields batches (a tensor, a tuple or a dict
    that the model's forward takes). A hook that accepts rank and world_size shards the data itself:
    it gets batch_size = micro_batch and yields this rank's micro-batches. A hook that does not gets
    batch_size = dp_size * micro_batch, and each rank keeps its own rows of every batch.
    Without a hook: synthetic token ids (a model whose input is not token ids must define train_data).
    """
    # zplan.model.model_file.ModelFile keeps the file's own hook in user_train_data (its train_data
    # method falls back to uniform random tokens, which nothing can learn).
    if data is not None:
        return token_batches(data, seq_len=seq_len, micro_batch=micro_batch, num_micro_batches=num_micro_batches,
                             dp_rank=dp_rank, dp_size=dp_size, seed=seed)
    train_data = getattr(model_file, "user_train_data", getattr(model_file, "train_data", None))
    if train_data is None:
        return synthetic_token_batches(
            vocab=vocab, seq_len=seq_len, micro_batch=micro_batch, num_micro_batches=num_micro_batches,
            dp_rank=dp_rank, dp_size=dp_size, seed=seed,
        )
    shards_itself = {"rank", "world_size"} <= set(_accepted_kwargs(train_data, rank=0, world_size=1))
    batch_size = micro_batch if shards_itself else dp_size * micro_batch
    kwargs = _accepted_kwargs(
        train_data, batch_size=batch_size, seq_len=seq_len, rank=dp_rank, world_size=dp_size, seed=seed
    )
    batches = iter(train_data(**kwargs))
    return batches if shards_itself else _slices_of_global_batches(batches, micro_batch, dp_rank)
