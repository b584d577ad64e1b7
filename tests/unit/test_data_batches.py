"""Packing, order, sharding over data-parallel ranks and the data position of a resume (runtime/data), against
references written here: token ids 0..N-1 so that each sequence shows where it came from."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch

from zplan.errors import CheckpointError
from zplan.runtime.checkpoint.read import train_state_problem
from zplan.runtime.data.errors import DataError
from zplan.runtime.data.packing import SequenceOrder, num_sequences, windows
from zplan.runtime.data.position import ALLOW_OTHER_DATA_FLAG, data_record, resume_data
from zplan.runtime.data.source import TokenData, token_batches
from zplan.runtime.training.data import make_data_iter

T = 8  # tokens per sequence
NUM_TOKENS = 7 * 40 + 1  # 40 sequences of 8 sharing one token each
NO_HOOK = types.SimpleNamespace(user_train_data=None)


def data(num_tokens: int = NUM_TOKENS) -> TokenData:
    identity = {"kind": "tokens", "bytes": 2 * num_tokens}
    return TokenData(Path("tokens.bin"), np.arange(num_tokens, dtype=np.int64), identity)


def sequence_id(row: torch.Tensor) -> int:
    """Sequence i starts at token i * (T - 1) (ids 0..N-1: the first id says where)."""
    first = int(row[0])
    assert first % (T - 1) == 0 and torch.equal(row, torch.arange(first, first + T))
    return first // (T - 1)


def step_ids(iterator, num_micro_batches: int) -> list[int]:
    return [sequence_id(row) for _ in range(num_micro_batches) for row in next(iterator)]


def test_packing_covers_every_next_token_once():
    assert num_sequences(NUM_TOKENS, T) == 40 and num_sequences(NUM_TOKENS - 1, T) == 39 and num_sequences(7, T) == 0
    tokens = np.arange(NUM_TOKENS)
    rows = windows(tokens, np.arange(40), T)  # (40, T)
    assert rows.shape == (40, T) and rows.dtype == np.int64
    pairs = [(int(a), int(b)) for row in rows for a, b in zip(row[:-1], row[1:], strict=True)]
    assert sorted(pairs) == [(t, t + 1) for t in range(NUM_TOKENS - 1)]  # each next-token target exactly once
    with pytest.raises(DataError, match="--seq 2"):
        num_sequences(10, 1)


def test_order_is_a_permutation_per_epoch_and_a_function_of_the_seed():
    order = SequenceOrder(40, seed=3)
    first, second = order.ids(0, 40), order.ids(40, 40)
    assert sorted(first) == list(range(40)) and sorted(second) == list(range(40))
    assert not np.array_equal(first, second)  # a new permutation each epoch
    assert np.array_equal(order.ids(35, 10), np.concatenate([first[35:], second[:5]]))  # a batch across epochs
    assert np.array_equal(SequenceOrder(40, seed=3).ids(0, 80), order.ids(0, 80))
    assert not np.array_equal(SequenceOrder(40, seed=4).ids(0, 40), first)
    assert np.array_equal(SequenceOrder(40, seed=3, shuffle=False).ids(38, 4), [38, 39, 0, 1])


@pytest.mark.parametrize("dp,micro_batch,num_micro_batches", [(2, 2, 2), (4, 1, 2), (2, 1, 4)])
def test_ranks_split_the_global_batch_of_one_process(dp, micro_batch, num_micro_batches):
    """Each step, the ranks' micro-batches together are the global batch of one process (G = 8), rank r taking the
    r-th contiguous slice, as synthetic data does."""
    kwargs = dict(vocab=NUM_TOKENS, seq_len=T, seed=5, data=data())
    single = make_data_iter(NO_HOOK, micro_batch=8, num_micro_batches=1, dp_rank=0, dp_size=1, **kwargs)
    ranks = [make_data_iter(NO_HOOK, micro_batch=micro_batch, num_micro_batches=num_micro_batches, dp_rank=r,
                            dp_size=dp, **kwargs) for r in range(dp)]
    seen = []
    for _ in range(10):  # two epochs of 40
        whole = step_ids(single, 1)
        assert [i for rank in ranks for i in step_ids(rank, num_micro_batches)] == whole
        seen += whole
    assert sorted(seen[:40]) == list(range(40)) and sorted(seen[40:]) == list(range(40))


def test_resume_goes_on_at_the_next_unseen_sequence_under_another_dp():
    """2 steps at dp 2, the position recorded, 2 more at dp 1: the 4 global batches of an uninterrupted run."""
    uninterrupted = token_batches(data(), seq_len=T, micro_batch=8, num_micro_batches=1, dp_rank=0, dp_size=1,
                                  seed=9)
    expected = [step_ids(uninterrupted, 1) for _ in range(4)]
    ranks = [token_batches(data(), seq_len=T, micro_batch=2, num_micro_batches=2, dp_rank=r, dp_size=2, seed=9)
             for r in range(2)]
    for step in range(2):
        assert step_ids(ranks[0], 2) + step_ids(ranks[1], 2) == expected[step]
    record = data_record(ranks[0], "tokens.bin", 2)
    assert record["sequences_consumed"] == 16 and record["identity"]["seed"] == 9
    resumed = token_batches(data(), seq_len=T, micro_batch=2, num_micro_batches=4, dp_rank=0, dp_size=1, seed=9)
    assert resume_data(resumed, "tokens.bin", record, 2, Path("step-000002"), allow_other=False) is None
    assert [step_ids(resumed, 4) for _ in range(2)] == expected[2:]
    assert resumed.sequences_at(4) == 32


def test_resume_on_other_data_is_refused_unless_allowed():
    ours = token_batches(data(), seq_len=T, micro_batch=2, num_micro_batches=1, dp_rank=0, dp_size=1, seed=1)
    record = data_record(ours, "tokens.bin", 3)
    for other in (token_batches(data(), seq_len=T, micro_batch=2, num_micro_batches=1, dp_rank=0, dp_size=1, seed=2),
                  token_batches(data(NUM_TOKENS + 7), seq_len=T, micro_batch=2, num_micro_batches=1, dp_rank=0,
                                dp_size=1, seed=1)):
        with pytest.raises(DataError, match=ALLOW_OTHER_DATA_FLAG):
            resume_data(other, "other.bin", record, 3, Path("step-000003"), allow_other=False)
        note = resume_data(other, "other.bin", record, 3, Path("step-000003"), allow_other=True)
        assert ALLOW_OTHER_DATA_FLAG in note and other.sequences_at(3) == 0  # from its first sequence
    with pytest.raises(DataError, match="trained without --data"):
        resume_data(ours, "tokens.bin", None, 3, Path("step-000003"), allow_other=False)
    with pytest.raises(DataError, match="this run has no --data"):
        resume_data(None, None, record, 3, Path("step-000003"), allow_other=False)
    assert resume_data(None, None, None, 3, Path("step-000003"), allow_other=False) is None
    with pytest.raises(DataError, match="damaged"):
        resume_data(ours, "tokens.bin", {**record, "sequences_consumed": -1}, 3, Path("s"), allow_other=False)


def test_train_state_data_field_is_checked():
    state = {"step": 2, "world_size": 2, "data": {"sequences_consumed": 16, "identity": {}}}
    assert train_state_problem(state, Path("step-000002")) is None
    assert "'data'" in train_state_problem({**state, "data": 5}, Path("step-000002"))
    assert issubclass(DataError, Exception) and not issubclass(DataError, CheckpointError)


def test_a_memory_map_handed_back_every_few_batches_gives_the_same_batches(tmp_path, monkeypatch):
    """The pages release_pages hands back are mapped again from the file on the next read: with a release before
    nearly every micro-batch, a token file's batches equal those of the same ids held in memory."""
    import zplan.runtime.data.batches as batches
    from zplan.runtime.data.token_file import is_mapped, sidecar_path, sidecar_text

    ids = np.random.default_rng(0).integers(0, 1000, 200_000, dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    path.write_bytes(ids.tobytes())
    sidecar_path(path).write_text(sidecar_text(dtype="uint16", vocab_size=1000, separator=None, tokenizer=None,
                                               num_tokens=len(ids), documents=None))
    monkeypatch.setattr(batches, "RELEASE_BYTES", 100_000)  # under the file's 400 kB: a release before each batch
    released = []
    real_release = batches.release_pages
    monkeypatch.setattr(batches, "release_pages", lambda tokens: released.append(1) or real_release(tokens))
    mapped = np.memmap(path, dtype=np.uint16, mode="r")
    assert is_mapped(mapped)
    options = dict(seq_len=64, micro_batch=2, num_micro_batches=1, dp_rank=0, dp_size=1, seed=3)
    from_file = batches.TokenBatches(mapped, **options)
    in_memory = batches.TokenBatches(np.array(ids), **options)
    for _ in range(200):
        assert torch.equal(next(from_file), next(in_memory))
    assert len(released) == 199  # the file's pages were handed back before every batch but the first
