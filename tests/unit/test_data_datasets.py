"""A Hugging Face dataset saved with `save_to_disk` as data (runtime/data/documents.py): `zplan data prepare DIR` and
train.py --data DIR read its "text" column as the same documents given as a .jsonl file would be; a DatasetDict is
read through its 'train' split (said on the log) or refused naming its splits; a dataset without a "text" column of
strings, or with no text, is refused with a DataError naming the folder and the fix."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_data_files import DOCUMENTS, make_tokenizer, reference_ids
from zplan.runtime.data.documents import data_kind, document_batches
from zplan.runtime.data.errors import DataError
from zplan.runtime.data.prepare import prepare
from zplan.runtime.data.source import open_data
from zplan.runtime.data.token_file import open_token_file

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(autouse=True)
def _quiet_datasets():
    datasets.disable_progress_bars()  # save_to_disk's bars on stderr; nothing else changes
    yield
    datasets.enable_progress_bars()


def save_dataset(folder: Path, columns: dict) -> Path:
    datasets.Dataset.from_dict(columns).save_to_disk(str(folder))
    return folder


def write_jsonl(path: Path, documents: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    return path


def refused(fn, *needles: str) -> str:
    with pytest.raises(DataError) as error:
        fn()
    message = str(error.value)
    for needle in needles:
        assert needle in message, message
    return message


def test_prepare_and_open_match_jsonl(tmp_path, tokenizer_folder):
    folder = save_dataset(tmp_path / "ds", {"text": DOCUMENTS, "id": list(range(len(DOCUMENTS)))})
    jsonl = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    assert data_kind(folder) == "dataset"
    done = prepare([folder], tokenizer_folder, tmp_path / "ds.bin", batch=2)  # batches of 2: order kept across them
    prepare([jsonl], tokenizer_folder, tmp_path / "jsonl.bin")
    assert done.documents == len(DOCUMENTS)
    assert (tmp_path / "ds.bin").read_bytes() == (tmp_path / "jsonl.bin").read_bytes()
    expected = reference_ids(tokenizer_folder, DOCUMENTS)
    assert np.array_equal(open_token_file(tmp_path / "ds.bin").tokens, expected)
    opened = open_data(folder, vocab=300, tokenizer=tokenizer_folder)  # train.py --data DIR --tokenizer TOK
    assert np.array_equal(opened.tokens, expected)
    assert opened.identity["kind"] == "dataset" and opened.identity["bytes"] > 0
    assert opened.identity["tokens_sha256"] == open_data(jsonl, vocab=300, tokenizer=tokenizer_folder) \
        .identity["tokens_sha256"]


def test_missing_and_blank_texts_are_skipped(tmp_path, tokenizer_folder):
    folder = save_dataset(tmp_path / "ds", {"text": [DOCUMENTS[0], None, "  ", DOCUMENTS[1]]})
    batches = list(document_batches(folder, batch=3))
    assert batches == [([DOCUMENTS[0]], 3), ([DOCUMENTS[1]], 4)]  # (documents, rows read so far)
    opened = open_data(folder, vocab=300, tokenizer=tokenizer_folder)
    assert np.array_equal(opened.tokens, reference_ids(tokenizer_folder, DOCUMENTS[:2]))


def test_dataset_dict_reads_train_split(tmp_path, tokenizer_folder, caplog):
    train = datasets.Dataset.from_dict({"text": DOCUMENTS[:3]})
    test = datasets.Dataset.from_dict({"text": DOCUMENTS[3:]})
    folder = tmp_path / "dict"
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(folder))
    with caplog.at_level(logging.WARNING, logger="zplan.runtime.data.documents"):
        done = prepare([folder], tokenizer_folder, tmp_path / "dict.bin")
    assert done.documents == 3
    assert np.array_equal(open_token_file(tmp_path / "dict.bin").tokens,
                          reference_ids(tokenizer_folder, DOCUMENTS[:3]))
    assert "['test', 'train']" in caplog.text and "'train' split only" in caplog.text
    only_train = tmp_path / "only_train"
    datasets.DatasetDict({"train": train}).save_to_disk(str(only_train))
    opened = open_data(only_train, vocab=300, tokenizer=tokenizer_folder)
    assert np.array_equal(opened.tokens, reference_ids(tokenizer_folder, DOCUMENTS[:3]))
    # an empty other split (which datasets' own load_from_disk of the whole dict fails on): 'train' still read
    empty_test = tmp_path / "empty_test"
    datasets.DatasetDict({"train": train, "test": datasets.Dataset.from_dict({"text": []})}).save_to_disk(
        str(empty_test))
    assert [docs for docs, _ in document_batches(empty_test)] == [DOCUMENTS[:3]]


def test_dataset_dict_without_train_is_refused(tmp_path, tokenizer_folder):
    folder = tmp_path / "no_train"
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": DOCUMENTS}),
                          "test": datasets.Dataset.from_dict({"text": DOCUMENTS})}).save_to_disk(str(folder))
    refused(lambda: prepare([folder], tokenizer_folder, tmp_path / "never.bin"), str(folder),
            "['test', 'validation']", "no 'train' split", ".save_to_disk(DIR)")
    refused(lambda: open_data(folder, vocab=300, tokenizer=tokenizer_folder), "['test', 'validation']")
    assert not (tmp_path / "never.bin").exists()


def test_bad_datasets_are_refused(tmp_path, tokenizer_folder):
    def refuses(folder: Path, *needles: str) -> None:
        refused(lambda: prepare([folder], tokenizer_folder, tmp_path / "never.bin"), str(folder), *needles)
        refused(lambda: open_data(folder, vocab=300, tokenizer=tokenizer_folder), str(folder), *needles)

    refuses(save_dataset(tmp_path / "body", {"body": DOCUMENTS, "id": list(range(5))}), "no 'text' column",
            "['body', 'id']", "rename_column")
    refuses(save_dataset(tmp_path / "empty", {"text": []}), "holds no rows")
    refuses(save_dataset(tmp_path / "blank", {"text": ["", " ", None]}), "holds no text")
    refuses(save_dataset(tmp_path / "numbers", {"text": [1, 2, 3]}), "int64", "not strings")
    empty_train = tmp_path / "empty_train"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": []})}).save_to_disk(str(empty_train))
    refuses(empty_train, "'train' split", "holds no rows")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "dataset_info.json").write_text("{}")  # the marker, but nothing save_to_disk writes beside it
    refuses(broken, "cannot load the dataset", "save_to_disk")
    refused(lambda: open_data(save_dataset(tmp_path / "no_tok", {"text": DOCUMENTS}), vocab=300), "needs a tokenizer",
            "zplan data prepare")
    assert not (tmp_path / "never.bin").exists()
