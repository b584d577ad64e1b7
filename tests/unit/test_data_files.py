"""Data files (runtime/data): token files and their sidecars, text and JSON lines tokenized with a tokenizer trained
here, `zplan data prepare`, and every bad input refused with one message naming the file and the fix (exit status 2),
nothing written. The reference for tokenized text is the tokenizer itself, one document at a time."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from zplan.cli import app
from zplan.runtime.data.documents import data_kind
from zplan.runtime.data.errors import DataError
from zplan.runtime.data.prepare import prepare
from zplan.runtime.data.source import open_data
from zplan.runtime.data.token_file import open_token_file, sidecar_path, write_token_file
from zplan.runtime.data.tokenizer import load_tokenizer
from zplan.runtime.launch.arguments import parse_train_arguments
from zplan.runtime.training.data import open_run_data

DOCUMENTS = ["the quick brown fox jumps over the lazy dog", "hello world, hello zplan", "a b c d e f g",
             "tokens packed into sequences", "the dog sleeps"]


def make_tokenizer(folder: Path) -> Path:
    """A byte-level BPE trained on DOCUMENTS (256 byte ids, two special tokens, a few merges), saved as
    save_pretrained writes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCUMENTS, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def reference_ids(tokenizer_dir: Path, documents: list[str]) -> np.ndarray:
    """Each document encoded alone by transformers' tokenizer, followed by its eos id."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    ids: list[int] = []
    for doc in documents:
        ids += hf(doc, add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
    return np.array(ids, dtype=np.int64)


def write_tokens(path: Path, ids, vocab: int = 64, dtype: str = "uint16") -> Path:
    write_token_file(path, [np.asarray(ids)], dtype=dtype, vocab_size=vocab, separator=0, tokenizer=None,
                     documents=None)
    return path


def test_token_file_round_trip(tmp_path):
    ids = np.arange(1000) % 64
    path = write_tokens(tmp_path / "t.bin", ids)
    opened = open_token_file(path)
    assert isinstance(opened.tokens, np.memmap) and opened.dtype == "uint16"
    assert np.array_equal(opened.tokens, ids) and opened.size_bytes == 2000
    meta = json.loads(sidecar_path(path).read_text())
    assert meta["num_tokens"] == 1000 and meta["vocab_size"] == 64 and meta["separator"] == 0
    assert data_kind(path) == "tokens"
    write_tokens(tmp_path / "u.bin", ids, vocab=70000, dtype="uint32")
    assert open_token_file(tmp_path / "u.bin").tokens.dtype == np.dtype("<u4")


def test_prepare_matches_the_tokenizer_and_is_deterministic(tmp_path, tokenizer_dir):
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(DOCUMENTS[:3]) + "\n\n" + "\n".join(DOCUMENTS[3:]) + "\n")
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCUMENTS)))
    expected = reference_ids(tokenizer_dir, DOCUMENTS)
    done = prepare([text], tokenizer_dir, tmp_path / "a.bin", batch=2)  # batches of 2: order kept across them
    assert done.tokens == len(expected) and done.documents == len(DOCUMENTS) and done.dtype == "uint16"
    assert np.array_equal(open_token_file(tmp_path / "a.bin").tokens, expected)
    prepare([jsonl], tokenizer_dir, tmp_path / "b.bin")
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    prepare([text, jsonl], tokenizer_dir, tmp_path / "c.bin")
    assert np.array_equal(open_token_file(tmp_path / "c.bin").tokens, np.concatenate([expected, expected]))
    # text given to train.py directly: the same ids as the prepared file
    opened = open_data(text, vocab=300, tokenizer=tokenizer_dir)
    assert np.array_equal(opened.tokens, expected) and opened.identity["kind"] == "text"


def test_cli_prepare(tmp_path, tokenizer_dir):
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(DOCUMENTS) + "\n")
    out = tmp_path / "tokens.bin"
    result = CliRunner().invoke(app, ["data", "prepare", str(text), "--tokenizer", str(tokenizer_dir), "-o",
                                      str(out)])
    assert result.exit_code == 0, result.output
    assert "tokens/s" in result.output
    assert np.array_equal(open_token_file(out).tokens, reference_ids(tokenizer_dir, DOCUMENTS))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    result = CliRunner().invoke(app, ["data", "prepare", str(empty), "--tokenizer", str(tokenizer_dir), "-o",
                                      str(tmp_path / "never.bin")])
    assert result.exit_code == 2 and "holds no text" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "empty.txt", "tokens.bin", "tokens.bin.json"]


def _refused(fn, *needles: str) -> str:
    with pytest.raises(DataError) as error:
        fn()
    message = str(error.value)
    for needle in needles:
        assert needle in message, message
    return message


def test_bad_token_files(tmp_path):
    lying = write_tokens(tmp_path / "lying.bin", np.arange(100) % 64, vocab=32)  # its sidecar says ids < 32
    _refused(lambda: open_data(lying, vocab=32), "token id 63", "vocabulary has 32", str(lying))
    path = write_tokens(tmp_path / "t.bin", np.arange(100) % 64)
    with open(path, "ab") as f:  # one byte more: cut short, not a whole number of uint16 ids
        f.write(b"\x00")
    _refused(lambda: open_data(path, vocab=64), "not a whole number", "zplan data prepare")
    with open(path, "ab") as f:  # a whole id more: the sidecar's count disagrees
        f.write(b"\x00")
    _refused(lambda: open_data(path, vocab=64), "sidecar", "says 100")
    bare = tmp_path / "bare.bin"
    bare.write_bytes(b"\x00\x00" * 10)
    _refused(lambda: open_data(bare, vocab=64), "no sidecar", "zplan data prepare")
    big = write_tokens(tmp_path / "big.bin", np.arange(100), vocab=1000)
    _refused(lambda: open_data(big, vocab=64), "vocabulary of 1000", "the model's 64")
    sidecar_path(big).write_text('{"dtype": "int8", "vocab_size": 10, "num_tokens": 100}')
    _refused(lambda: open_data(big, vocab=64), "uint16 or uint32")


def test_bad_text_and_tokenizers(tmp_path, tokenizer_dir):
    text = tmp_path / "c.txt"
    text.write_text("\n".join(DOCUMENTS) + "\n")
    _refused(lambda: open_data(text, vocab=300), "needs a tokenizer", "--tokenizer DIR")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _refused(lambda: open_data(empty, vocab=300, tokenizer=tokenizer_dir), str(empty), "holds no text")
    nothing = tmp_path / "no_tokenizer"
    nothing.mkdir()
    _refused(lambda: load_tokenizer(nothing), str(nothing), "holds no tokenizer", "save_pretrained")
    _refused(lambda: open_data(text, vocab=100, tokenizer=tokenizer_dir), "more than the model's vocabulary of 100")
    lines = tmp_path / "c.jsonl"
    lines.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    _refused(lambda: open_data(lines, vocab=300, tokenizer=tokenizer_dir), f"{lines} line 2", '"text"')
    folder = tmp_path / "dataset"
    folder.mkdir()
    (folder / "dataset_info.json").write_text("{}")
    try:
        import datasets  # noqa: F401
    except ImportError:  # without the optional package: one message saying what to install or do instead
        _refused(lambda: open_data(folder, vocab=300, tokenizer=tokenizer_dir), "pip install datasets", "to_json")


def test_run_data_refusals(tmp_path):
    path = write_tokens(tmp_path / "t.bin", np.arange(200) % 64)
    hooked = types.SimpleNamespace(user_train_data=lambda batch_size, seq_len: iter(()), path=Path("model.py"))
    plain = types.SimpleNamespace(user_train_data=None)
    options = dict(tokenizer=None, vocab=64, seq_len=16, global_batch=4, eval_batches=1)
    _refused(lambda: open_run_data(hooked, data=str(path), val_data=None, **options), "train_data hook",
             "Drop --data")
    # 200 tokens: 13 sequences of 16; 4 global batches of 4 need 16
    _refused(lambda: open_run_data(plain, data=None, val_data=str(path), **{**options, "eval_batches": 4}),
             "fewer than the 16", "--eval-batches")
    opened = open_run_data(plain, data=str(path), val_data=str(path), **{**options, "eval_batches": 3})
    assert opened.train.identity == opened.val.identity and opened.train.identity["bytes"] == 400


def test_train_arguments():
    args = parse_train_arguments(None, 1e-3, ["--data", "t.bin", "--val-data", "v.bin", "--eval-every", "5",
                                               "--eval-batches", "2", "--allow-other-data"])
    assert (args.data, args.val_data, args.eval_every, args.eval_batches, args.allow_other_data) == \
        ("t.bin", "v.bin", 5, 2, True)
    for argv in (["--eval-every", "5"], ["--tokenizer", "tok"], ["--data", ""], ["--val-data", "v", "--eval-batches",
                                                                                 "0"]):
        with pytest.raises(SystemExit) as exit_:
            parse_train_arguments(None, 1e-3, argv)
        assert exit_.value.code == 2
