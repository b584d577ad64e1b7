"""A Hugging Face tokenizer from a local folder (--tokenizer DIR, what `save_pretrained` wrote; nothing downloaded):
loaded, checked, and used to turn documents into ids with its batch API (a fast tokenizer encodes a batch on all
cores in Rust)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from zplan.runtime.data.errors import DataError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class Tokenizer:
    """A loaded tokenizer: its vocabulary size (len(tokenizer): added tokens included), the separator put after each
    document (its end-of-sequence token, else its beginning-of-sequence one) and a name for the sidecar."""

    folder: Path
    hf: object  # transformers' tokenizer
    vocab_size: int
    separator: int
    name: str

    def encode_raw(self, documents: list[str]) -> list:
        """The tokenizer's own output for `documents`, without special tokens: the Rust tokenizer's encodings (its
        batch over all cores, the GIL released: another thread may run meanwhile), else each document's ids."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is not None:  # encode_batch_fast (tokenizers >= 0.20): the same ids, no character offsets
            batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
            return batch(documents, add_special_tokens=False)
        return self.hf(documents, add_special_tokens=False)["input_ids"]

    @staticmethod
    def ids_of(raw: list) -> list[list[int]]:
        """Each document's ids from encode_raw's output."""
        return [e.ids for e in raw] if raw and not isinstance(raw[0], list) else raw

    def encode(self, documents: list[str]) -> list[list[int]]:
        """Each document's ids, without special tokens (the separator is put between documents by the caller)."""
        return self.ids_of(self.encode_raw(documents))

    def join(self, ids: list[list[int]], dtype=np.int64) -> np.ndarray:
        """`ids` (each document's), each followed by the separator, as one array of `dtype` (one pass over the ids,
        no list concatenation)."""
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
        return np.insert(flat, np.cumsum(lengths), np.asarray(self.separator, dtype=dtype))

    def encode_joined(self, documents: list[str], dtype=np.int64) -> np.ndarray:
        """The ids of `documents`, each followed by the separator, as one array of `dtype` (int64 unless told)."""
        return self.join(self.encode(documents), dtype)


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer saved in `folder` (DataError when there is none, or it has no end-of-sequence token)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"--tokenizer {folder} is not a folder: give the folder where tokenizer.save_pretrained wrote "
                        "tokenizer.json / tokenizer_config.json")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise DataError(f"tokenizer folder {folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): give "
                        "the folder where tokenizer.save_pretrained wrote them")
    try:
        from transformers import AutoTokenizer  # optional dependency: transformers (zplan[hf])
    except ImportError as error:
        raise DataError(f"--tokenizer {folder} needs transformers: pip install 'zplan[hf]'") from error
    try:
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError... for a folder it cannot read
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"cannot load the tokenizer in {folder} ({first}): give a folder written by "
                        "tokenizer.save_pretrained") from error
    separator = hf.eos_token_id if hf.eos_token_id is not None else hf.bos_token_id
    if separator is None:
        raise DataError(f"the tokenizer in {folder} has no end-of-sequence (or beginning-of-sequence) token to put "
                        "between documents: set eos_token in its tokenizer_config.json")
    name = getattr(hf, "name_or_path", "") or folder.name
    return Tokenizer(folder, hf, len(hf), int(separator), Path(name).name or folder.name)


def check_tokenizer_fits(tokenizer: Tokenizer, vocab: int) -> None:
    """DataError when the tokenizer can make ids the model has no embedding for."""
    if tokenizer.vocab_size > vocab:
        raise DataError(f"the tokenizer in {tokenizer.folder} has {tokenizer.vocab_size} ids, more than the model's "
                        f"vocabulary of {vocab}: use the model's own tokenizer, or compile for a model whose "
                        f"vocabulary holds {tokenizer.vocab_size}")
