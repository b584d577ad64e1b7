"""Where a run stands in its data, as a checkpoint's train_state.json records it, and where a resumed run goes on.

    "data": {"path": "tokens.bin", "sequences_consumed": 96,
             "identity": {"kind": "tokens", "bytes": 2048, "sidecar_sha256": "...", "seed": 0, "seq_len": 16,
                          "sequences": 136}}

The position is global (positions of the seeded order, not per rank), so a run resumed under another data-parallel
size, or another global batch, goes on at the next unseen sequence. A run resumed on other data than the record's
(another file, size, sidecar, tokenizer, seed or packing; or a checkpoint of synthetic data or a train_data hook
resumed with --data, or the other way round) is refused unless --allow-other-data is given: then the new data starts
at its first sequence.
"""

from __future__ import annotations

from pathlib import Path

from zplan.runtime.data.batches import TokenBatches
from zplan.runtime.data.errors import DataError

ALLOW_OTHER_DATA_FLAG = "--allow-other-data"  # train.py's


def data_record(batches: TokenBatches, path: str | Path, steps_done: int) -> dict:
    """train_state.json's "data" once `steps_done` optimizer steps are done."""
    return {"path": str(path), "sequences_consumed": batches.sequences_at(steps_done),
            "identity": dict(batches.identity)}


def record_problem(record: object) -> str | None:
    """What makes a train_state.json's "data" record unreadable (it is data zplan reads back), or None."""
    if not isinstance(record, dict):
        return f"'data' is a {type(record).__name__}, not an object"
    consumed = record.get("sequences_consumed")
    if type(consumed) is not int or consumed < 0:
        return f"'data.sequences_consumed' is {consumed!r}, not a whole number >= 0"
    if not isinstance(record.get("identity"), dict) or not isinstance(record.get("path", ""), str):
        return "'data.identity' is not an object, or 'data.path' not a string"
    return None


def _differences(recorded: dict, ours: dict) -> list[str]:
    return [f"{key} {recorded.get(key)!r} there, {ours.get(key)!r} here" for key in sorted(set(recorded) | set(ours))
            if recorded.get(key) != ours.get(key)]


def resume_data(batches: TokenBatches | None, path: str | Path | None, record: object, steps_done: int,
                checkpoint: Path, *, allow_other: bool) -> str | None:
    """Put `batches` (this run's --data, or None for synthetic data or a train_data hook) where the checkpoint's
    `record` (None: it recorded no data file) says, for a resume after `steps_done` steps. Returns a note to print
    when the data changed with `allow_other`; DataError when it changed without."""
    if record is None and batches is None:
        return None
    if record is not None:
        problem = record_problem(record)
        if problem:
            raise DataError(f"cannot read the data position in {checkpoint}/train_state.json ({problem}): the "
                            f"checkpoint is damaged; resume from an older one, or give {ALLOW_OTHER_DATA_FLAG} to "
                            "start the data from its first sequence")
    if record is not None and batches is not None and record["identity"] == batches.identity:
        batches.seek(steps_done, record["sequences_consumed"])
        return None
    if record is None:
        why = f"{checkpoint} was trained without --data (synthetic data or the model file's train_data hook)"
    elif batches is None:
        why = (f"{checkpoint} was trained on --data {record.get('path')}, and this run has no --data (it would train "
               "on synthetic data or the model file's train_data hook)")
    else:
        why = (f"{checkpoint} was trained on --data {record.get('path')}, which differs from this run's --data "
               f"{path} ({'; '.join(_differences(record['identity'], batches.identity))})")
    if not allow_other:
        raise DataError(f"{why}: resuming would not go on with the same sequences. Give the same data, seed and "
                        f"plan's sequence length, or {ALLOW_OTHER_DATA_FLAG} to go on with this run's data from its "
                        "first sequence")
    if batches is not None:
        batches.seek(steps_done, 0)
    return f"{why}; {ALLOW_OTHER_DATA_FLAG}: this run's data starts at its first sequence"
