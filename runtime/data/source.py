"""Opening train.py's --data / --val-data for a run: a token file memory-mapped, or text, JSON lines or a saved
dataset tokenized in memory with --tokenizer (each rank the same ids; `zplan data prepare` once for a large corpus);
checked against the model's vocabulary and the plan's batch before any collective, and identified (file size, the
sidecar's or the ids' hash, the seed and the packing) for the checkpoint's record."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zplan.runtime.data.batches import TokenBatches
from zplan.runtime.data.documents import data_kind, document_batches
from zplan.runtime.data.errors import DataError
from zplan.runtime.data.packing import num_sequences
from zplan.runtime.data.token_file import check_ids_below, open_token_file
from zplan.runtime.data.tokenizer import Tokenizer, check_tokenizer_fits, load_tokenizer


@dataclass(frozen=True)
class TokenData:
    """Token ids of one data path, checked, and what identifies them (compared on resume)."""

    path: Path
    tokens: np.ndarray  # (num_tokens,), a memmap for a token file
    identity: dict  # kind, bytes, sidecar_sha256 or tokens_sha256, tokenizer


def open_data(path: str | Path, *, vocab: int, tokenizer: str | Path | None = None, option: str = "--data",
              loaded: dict | None = None) -> TokenData:
    """`path` as token ids below `vocab` (DataError naming the file and the fix). `loaded` caches the tokenizer
    between calls (--data and --val-data share it)."""
    path = Path(path)
    kind = data_kind(path)
    if kind == "tokens":
        token_file = open_token_file(path)
        if token_file.vocab_size > vocab:
            raise DataError(f"token file {path} was made with a vocabulary of {token_file.vocab_size} ids "
                            f"({token_file.tokenizer or 'its sidecar says'}), more than the model's {vocab}: prepare "
                            "it with the model's tokenizer, or compile for a model with a larger vocabulary")
        check_ids_below(token_file.tokens, vocab, f"token file {path}")
        return TokenData(path, token_file.tokens, {"kind": kind, "bytes": token_file.size_bytes,
                                                   "sidecar_sha256": token_file.sidecar_sha256})
    if tokenizer is None:
        raise DataError(f"{option} {path} is {'a dataset' if kind == 'dataset' else kind} and needs a tokenizer: "
                        "give --tokenizer DIR (a folder written by tokenizer.save_pretrained), or prepare a token "
                        f"file with `zplan data prepare {path} --tokenizer DIR -o tokens.bin`")
    cache = loaded if loaded is not None else {}
    if "tokenizer" not in cache:
        cache["tokenizer"] = load_tokenizer(tokenizer)
        check_tokenizer_fits(cache["tokenizer"], vocab)
    tok: Tokenizer = cache["tokenizer"]
    ids = np.concatenate([tok.encode_joined(docs) for docs, _ in document_batches(path)])
    size = sum(f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()) if path.is_dir() else \
        path.stat().st_size
    identity = {"kind": kind, "bytes": size, "tokens_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
                "tokenizer": tok.name}
    return TokenData(path, ids, identity)


def token_batches(data: TokenData, *, seq_len: int, micro_batch: int, num_micro_batches: int, dp_rank: int,
                  dp_size: int, seed: int, shuffle: bool = True, batches_needed: int = 1,
                  option: str = "--data") -> TokenBatches:
    """This rank's micro-batches of `data` (TokenBatches); DataError when it holds fewer sequences than
    `batches_needed` global batches."""
    global_batch = dp_size * num_micro_batches * micro_batch
    have = num_sequences(len(data.tokens), seq_len)
    if have < batches_needed * global_batch:
        need = batches_needed * global_batch
        raise DataError(f"{option} {data.path} holds {len(data.tokens):,} tokens: {have} sequences of {seq_len}, "
                        f"fewer than the {need} of {batches_needed} global batch(es) of {global_batch} sequences "
                        f"(about {need * (seq_len - 1) + 1:,} tokens): give more data"
                        + (" or fewer --eval-batches" if option == "--val-data" else ""))
    identity = {**data.identity, "seed": seed, "seq_len": seq_len, "sequences": have}
    return TokenBatches(data.tokens, seq_len=seq_len, micro_batch=micro_batch, num_micro_batches=num_micro_batches,
                        dp_rank=dp_rank, dp_size=dp_size, seed=seed, shuffle=shuffle, identity=identity)
