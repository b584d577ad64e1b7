"""Documents from files, in batches, in file order: a plain text file (one document per line, blank lines skipped, as
`datasets`' text loader reads it), a JSON-lines file (one object per line, its "text" field a document), or a Hugging
Face dataset saved with `save_to_disk` (its "text" column of strings, rows with no or blank text skipped; a
DatasetDict's 'train' split; needs the optional `datasets` package)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from zplan.runtime.data.errors import DataError
from zplan.runtime.data.token_file import sidecar_path
from zplan.safe_files import UnreadableFileError, read_json_capped

log = logging.getLogger(__name__)

TEXT_FIELD = "text"
TRAIN_SPLIT = "train"  # the split read from a DatasetDict
MAX_DATASET_JSON_BYTES = 16 << 20  # dataset_dict.json / state.json: ~1 KB each (state.json lists the shards)
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes
BATCH_DOCUMENTS = 1024  # documents per batch handed to the tokenizer


def data_kind(path: str | Path) -> str:
    """'tokens' (a token file: it has a sidecar, or ends in .bin), 'dataset' (a folder), 'jsonl' or 'text'."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data {path} does not exist: give a token file (tokens.bin with tokens.bin.json), a text or "
                        ".jsonl file, or a folder written by datasets' save_to_disk")
    if path.is_dir():
        return "dataset"
    if sidecar_path(path).exists() or path.suffix == ".bin":
        return "tokens"
    return "jsonl" if path.suffix in JSON_SUFFIXES else "text"


def input_size(path: str | Path) -> int | None:
    """The unit document_batches counts its progress in: a file's bytes; None for a dataset folder."""
    path = Path(path)
    return None if path.is_dir() else path.stat().st_size


def document_batches(path: str | Path, batch: int = BATCH_DOCUMENTS) -> Iterator[tuple[list[str], int]]:
    """(documents, input read so far: input_size's unit, rows of a dataset) in batches of up to `batch` documents;
    DataError for a file with no document, or a JSON line without a "text" string."""
    path = Path(path)
    kind = data_kind(path)
    if kind == "tokens":
        raise DataError(f"{path} is a token file: it is already tokenized (give it to train.py --data as it is)")
    found = False
    source = _dataset_batches(path, batch) if kind == "dataset" else _file_batches(path, kind, batch)
    for documents, done in source:
        found = found or bool(documents)
        if documents:
            yield documents, done
    if not found and kind == "dataset":
        raise DataError(f"the dataset in {path} holds no text (its '{TEXT_FIELD}' values are all empty or blank): "
                        f"save a dataset with documents in its '{TEXT_FIELD}' column")
    if not found:
        per_line = ' (a JSON object with a "text" field)' if kind == "jsonl" else ""
        raise DataError(f"{path} holds no text (an empty file, or only blank lines): give a file with one document "
                        f"per line{per_line}")


def _file_batches(path: Path, kind: str, batch: int) -> Iterator[tuple[list[str], int]]:
    documents: list[str] = []
    done = 0
    with open(path, "rb") as stream:
        for number, raw in enumerate(stream, start=1):
            done += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{path} line {number} is not UTF-8 text ({error.reason}): convert the file to "
                                "UTF-8") from error
            if not line.strip():
                continue
            documents.append(_json_text(path, number, line) if kind == "jsonl" else line.rstrip("\r\n"))
            if len(documents) == batch:
                yield documents, done
                documents = []
    yield documents, done


def _json_text(path: Path, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise DataError(f"{path} line {number} is not JSON ({error}): give one JSON object per line") from error
    text = record.get(TEXT_FIELD) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(f"{path} line {number} has no \"{TEXT_FIELD}\" string field: give one object per line "
                        f"with the document in \"{TEXT_FIELD}\"")
    return text


def _dataset_batches(path: Path, batch: int) -> Iterator[tuple[list[str], int]]:
    dataset = _load_dataset(path)
    rows = len(dataset)
    for start in range(0, rows, batch):
        texts = dataset[start:start + batch][TEXT_FIELD]
        yield [t for t in texts if t is not None and t.strip()], start + len(texts)  # None: a missing value


def _saved_json(path: Path, name: str) -> dict:
    """The JSON object save_to_disk wrote as `name` in `path` ({} when there is none)."""
    if not (path / name).is_file():
        return {}
    try:
        value, _ = read_json_capped(path / name, MAX_DATASET_JSON_BYTES, "dataset file")
    except UnreadableFileError as error:
        raise DataError(f"cannot read {path / name} ({error}): save the dataset again with save_to_disk") from error
    return value if isinstance(value, dict) else {}


def _load_dataset(path: Path):
    """The dataset saved in folder `path` (its 'train' split for a DatasetDict), reduced to its "text" column of
    strings; DataError naming what it holds and the fix otherwise."""
    if not any((path / name).is_file() for name in DATASET_MARKERS):
        raise DataError(f"{path} is a folder but not a dataset written by datasets' save_to_disk (no "
                        f"{' / '.join(DATASET_MARKERS)}): give that folder, a text file or a .jsonl file")
    try:
        import datasets  # optional dependency: Hugging Face datasets, only for a dataset saved on disk
    except ImportError as error:
        raise DataError(f"{path} is a Hugging Face dataset folder, which needs the `datasets` package: pip install "
                        "datasets, or export it as JSON lines (dataset.to_json('data.jsonl'))") from error
    folder, where = path, f"the dataset in {path}"
    if (path / "dataset_dict.json").is_file():  # a DatasetDict: one folder per split; only 'train' is loaded
        splits = _saved_json(path, "dataset_dict.json").get("splits")
        splits = sorted(str(s) for s in splits) if isinstance(splits, list) else []
        if TRAIN_SPLIT not in splits:
            raise DataError(f"{path} holds a DatasetDict with the splits {splits} and no '{TRAIN_SPLIT}' split: save "
                            f"the split to use on its own (dataset_dict['{splits[0] if splits else 'NAME'}']"
                            f".save_to_disk(DIR)) and give that folder, or name it '{TRAIN_SPLIT}'")
        if len(splits) > 1:
            log.warning("%s holds the splits %s: reading its '%s' split only", path, splits, TRAIN_SPLIT)
        folder, where = path / TRAIN_SPLIT, f"the '{TRAIN_SPLIT}' split of the dataset in {path}"
    if _saved_json(folder, "state.json").get("_data_files") == []:  # save_to_disk of 0 rows: no data file
        raise DataError(f"{where} holds no rows: save a dataset with documents in its '{TEXT_FIELD}' column")
    try:
        dataset = datasets.load_from_disk(str(folder))
    except Exception as error:  # datasets raises FileNotFoundError, ValueError... for a folder it cannot read
        raise DataError(f"cannot load the dataset in {path} ({type(error).__name__}: {error}): save it again with "
                        "dataset.save_to_disk and give that folder") from error
    if not isinstance(dataset, datasets.Dataset):
        raise DataError(f"{where} is a {type(dataset).__name__}, not one dataset: save the split to use on its own "
                        "with save_to_disk and give that folder")
    if TEXT_FIELD not in dataset.column_names:
        raise DataError(f"{where} has no '{TEXT_FIELD}' column (it has {dataset.column_names}): rename the text "
                        f"column to '{TEXT_FIELD}' (dataset.rename_column) and save it again")
    if len(dataset) == 0:
        raise DataError(f"{where} holds no rows: save a dataset with documents in its '{TEXT_FIELD}' column")
    feature = dataset.features[TEXT_FIELD]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"the '{TEXT_FIELD}' column of {where} holds {feature}, not strings: give one document "
                        f"per row as a string (dataset.cast_column('{TEXT_FIELD}', datasets.Value('string')) for "
                        "numbers)")
    return dataset.select_columns([TEXT_FIELD]).with_format(None)  # other columns never read; plain Python rows
