"""A byte-level tokenizer: UTF-8 bytes are the token ids 0..255; id 256 (when the vocabulary has it) ends a text.

It needs no vocabulary file, so any model with vocab >= 256 can be prompted with text (models trained on other
tokenizers will answer with noise; the ids are still valid).

    tok = ByteTokenizer(vocab_size=50257)
    ids = tok.encode("héllo")   # [104, 195, 169, 108, 108, 111]
    tok.decode(ids)             # "héllo"
"""

from __future__ import annotations

from zplan.errors import ZplanError

BYTE_IDS = 256  # ids 0..255 are the bytes


class ByteTokenizer:
    """encode: str -> UTF-8 byte ids; decode: ids -> str (ids >= 256 skipped, invalid UTF-8 replaced)."""

    def __init__(self, vocab_size: int):
        if vocab_size < BYTE_IDS:
            raise ZplanError(f"the byte tokenizer needs a vocabulary of at least {BYTE_IDS} ids (one per byte), "
                             f"the model has {vocab_size}: use a model with vocab_size >= {BYTE_IDS}.")
        self.vocab_size = vocab_size
        self.eos_id: int | None = BYTE_IDS if vocab_size > BYTE_IDS else None  # end of text

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_IDS).decode("utf-8", errors="replace")
