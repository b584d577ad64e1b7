"""`zplan data prepare`: text, JSON-lines or saved-dataset inputs tokenized into one token file and its sidecar
(token_file.py), the documents in input order, each followed by the tokenizer's separator.

The tokenizer's batch API does the work on all cores (a fast tokenizer's Rust thread pool); batches are encoded and
written in input order, so the output is the same bytes whatever the number of cores. The file and its sidecar are
written under temporary names and renamed into place: an interrupted run leaves no token file behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zplan.runtime.data.documents import data_kind, document_batches, input_size
from zplan.runtime.data.errors import DataError
from zplan.runtime.data.token_file import dtype_for, write_token_file
from zplan.runtime.data.tokenizer import Tokenizer, load_tokenizer

PREPARE_BATCH_DOCUMENTS = 4096  # documents per batch handed to the tokenizer (its threads split a batch)


@dataclass(frozen=True)
class Prepared:
    """What `prepare` wrote."""

    path: Path
    tokens: int
    documents: int
    dtype: str
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def check_inputs(inputs: Sequence[Path], out: Path) -> None:
    """DataError for an input that is missing or already a token file, or that is the output itself."""
    if not inputs:
        raise DataError("zplan data prepare needs at least one INPUT (a text, .jsonl or datasets path)")
    for path in inputs:
        if data_kind(path) == "tokens":
            raise DataError(f"{path} is already a token file (it has a sidecar or ends in .bin): give text, .jsonl "
                            "or a datasets folder")
        if Path(path).resolve() == Path(out).resolve():
            raise DataError(f"-o {out} is one of the inputs: write the token file elsewhere")


def _encoded(inputs: Sequence[Path], tokenizer: Tokenizer, batch: int, counts: dict,
             progress: Callable[[int, int], None]) -> Iterator[np.ndarray]:
    """Each batch's ids joined with separators, in input order; `progress(input units advanced, tokens)`."""
    for path in inputs:
        before = 0
        for documents, done in document_batches(path, batch):
            ids = tokenizer.encode_joined(documents)
            counts["documents"] += len(documents)
            counts["tokens"] += len(ids)
            progress(done - before, len(ids))
            before = done
            yield ids


def total_size(inputs: Sequence[Path]) -> int | None:
    """The progress total: the inputs' bytes (None when one is a dataset folder, counted in rows)."""
    sizes = [input_size(path) for path in inputs]
    return None if any(size is None for size in sizes) else sum(sizes)


def prepare(inputs: Sequence[str | Path], tokenizer_dir: str | Path, out: str | Path, *,
            progress: Callable[[int, int], None] = lambda advanced, tokens: None,
            batch: int = PREPARE_BATCH_DOCUMENTS) -> Prepared:
    """Tokenize `inputs` with the tokenizer in `tokenizer_dir` into the token file `out` and `out`.json."""
    inputs, out = [Path(p) for p in inputs], Path(out)
    check_inputs(inputs, out)
    tokenizer = load_tokenizer(tokenizer_dir)
    dtype = dtype_for(tokenizer.vocab_size)
    counts = {"documents": 0, "tokens": 0}
    start = time.perf_counter()
    written = write_token_file(out, _encoded(inputs, tokenizer, batch, counts, progress), dtype=dtype,
                               vocab_size=tokenizer.vocab_size, separator=tokenizer.separator, tokenizer=tokenizer.name,
                               documents=lambda: counts["documents"])  # known once the chunks are written
    return Prepared(out, written, counts["documents"], dtype, time.perf_counter() - start)
