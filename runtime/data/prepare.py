"""`zplan data prepare`: text, JSON-lines or saved-dataset inputs tokenized into one token file and its sidecar
(token_file.py), the documents in input order, each followed by the tokenizer's separator.

The tokenizer's batch API does the work on all cores (a fast tokenizer's Rust thread pool), in a worker thread that
encodes the next batches while this one reads, converts and writes; batches are written in input order, so the
output is the same bytes whatever the number of cores. The file and its sidecar are
written under temporary names and renamed into place: an interrupted run leaves no token file behind.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zplan.runtime.data.documents import data_kind, document_batches, input_size
from zplan.runtime.data.errors import DataError
from zplan.runtime.data.token_file import DTYPES, dtype_for, write_token_file
from zplan.runtime.data.tokenizer import Tokenizer, load_tokenizer

PREPARE_BATCH_DOCUMENTS = 4096  # documents per batch handed to the tokenizer (its threads split a batch)
IN_FLIGHT = 2  # batches handed to the encoding thread ahead of the one being written


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


def _encoded(inputs: Sequence[Path], tokenizer: Tokenizer, batch: int, counts: dict, dtype: str,
             progress: Callable[[int, int], None]) -> Iterator[np.ndarray]:
    """Each batch's ids joined with separators, as `dtype`, in input order; `progress(input units advanced, tokens)`.

    A worker thread runs the tokenizer (Rust, the GIL released) on the next batches while this thread reads the
    input, turns the last batch's encodings into one array and the caller writes it: at most IN_FLIGHT batches are
    encoded ahead, and they are taken in the order they were read, so the bytes are the same as one at a time."""

    def batches() -> Iterator[tuple[list[str], int]]:
        for path in inputs:
            before = 0
            for documents, done in document_batches(path, batch):
                yield documents, done - before
                before = done

    pending: deque = deque()  # (future of encode_raw, documents, input units advanced), oldest first
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="zplan-encode") as pool:
        try:
            for documents, advanced in batches():
                pending.append((pool.submit(tokenizer.encode_raw, documents), len(documents), advanced))
                if len(pending) > IN_FLIGHT:
                    yield _finish(pending.popleft(), tokenizer, dtype, counts, progress)
            while pending:
                yield _finish(pending.popleft(), tokenizer, dtype, counts, progress)
        finally:
            for future, _, _ in pending:  # an error (or the writer stopped): encode nothing more
                future.cancel()


def _finish(entry: tuple, tokenizer: Tokenizer, dtype: str, counts: dict,
            progress: Callable[[int, int], None]) -> np.ndarray:
    future, documents, advanced = entry
    ids = tokenizer.join(tokenizer.ids_of(future.result()), DTYPES[dtype])
    counts["documents"] += documents
    counts["tokens"] += len(ids)
    progress(advanced, len(ids))
    return ids


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
    written = write_token_file(out, _encoded(inputs, tokenizer, batch, counts, dtype, progress), dtype=dtype,
                               vocab_size=tokenizer.vocab_size, separator=tokenizer.separator, tokenizer=tokenizer.name,
                               documents=lambda: counts["documents"])  # known once the chunks are written
    return Prepared(out, written, counts["documents"], dtype, time.perf_counter() - start)
