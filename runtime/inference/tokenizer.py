"""A byte-level tokenizer: UTF-8 bytes are the token ids 0..255; id 256 (when the vocabulary has it) ends a text.
A Hugging Face folder's own tokenizer (HfTokenizer) instead when the model is such a folder with one
(load_tokenizer).

It needs no vocabulary file, so any model with vocab >= 256 can be prompted with text (models trained on other
tokenizers will answer with noise; the ids are still valid).

    tok = ByteTokenizer(vocab_size=50257)
    ids = tok.encode("héllo")   # [104, 195, 169, 108, 108, 111]
    tok.decode(ids)             # "héllo"

Chat (the server's POST /v1/chat/completions): chat_prompt(messages) is the prompt ids of a conversation. A Hugging
Face tokenizer with a chat template applies it (with the generation prompt); otherwise, and always for the byte
tokenizer, the plain template PLAIN_CHAT_TEMPLATE is used: one "role: content" line per message, then "assistant: ".
A model not trained on that format answers it as ordinary text.
"""

from __future__ import annotations

from pathlib import Path

from zplan.errors import ZplanError
from zplan.safe_files import UnreadableFileError, read_json_capped

BYTE_IDS = 256  # ids 0..255 are the bytes
PLAIN_CHAT_TEMPLATE = "{role}: {content}\n"  # a message of the plain chat template; the prompt ends "assistant: "
PLAIN_CHAT_REPLY = "assistant: "


def plain_chat_text(messages: list[dict]) -> str:
    """The plain chat template's text of `messages` ([{"role", "content": str}, ...]): "system: Be brief.\nuser:
    Hi\nassistant: "."""
    return "".join(PLAIN_CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) + \
        PLAIN_CHAT_REPLY


class ByteTokenizer:
    """encode: str -> UTF-8 byte ids; decode: ids -> str (ids >= 256 skipped, invalid UTF-8 replaced)."""

    def __init__(self, vocab_size: int):
        if vocab_size < BYTE_IDS:
            raise ZplanError(f"the byte tokenizer needs a vocabulary of at least {BYTE_IDS} ids (one per byte), "
                             f"the model has {vocab_size}: use a model with vocab_size >= {BYTE_IDS}.")
        self.vocab_size = vocab_size
        self.eos_id: int | None = BYTE_IDS if vocab_size > BYTE_IDS else None  # end of text
        self.max_chars_per_token = 1  # a character is 1 to 4 byte tokens

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_IDS).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The prompt ids of a conversation ([{"role", "content": str}, ...]): the plain template's bytes."""
        return self.encode(plain_chat_text(messages))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what save_pretrained writes beside a tokenizer
GENERATION_CONFIG = "generation_config.json"


class HfTokenizer:
    """The tokenizer saved in a Hugging Face folder (transformers' AutoTokenizer, nothing downloaded): encode as
    `tokenizer(text)` does (its special tokens included), decode without special tokens; eos_id from the folder's
    generation_config.json (the first when it lists several, as model.generate stops on), else the tokenizer's."""

    def __init__(self, folder: str | Path, vocab_size: int):
        try:
            # transformers: an optional dependency, needed only for a Hugging Face folder
            from transformers import AutoTokenizer
        except ImportError as error:
            raise ZplanError(f"{folder} holds a Hugging Face tokenizer, and transformers is not installed: "
                             "pip install transformers") from error
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as error:  # a damaged or unknown tokenizer
            line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ZplanError(f"cannot read the tokenizer in {folder} ({line}): put back the files "
                             "save_pretrained wrote") from error
        self.vocab_size = vocab_size
        # the longest token's text: a prompt of more characters than this times max_seq_len cannot fit
        self.max_chars_per_token = max((len(token) for token in self._tokenizer.get_vocab()), default=1)
        self.eos_id: int | None = _generation_eos(Path(folder))
        if self.eos_id is None:
            self.eos_id = self._tokenizer.eos_token_id
        if self.eos_id is not None and not 0 <= self.eos_id < vocab_size:
            self.eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The prompt ids of a conversation ([{"role", "content": str}, ...]): the tokenizer's chat template with
        the generation prompt when it has one, else the plain template (plain_chat_text) encoded."""
        if getattr(self._tokenizer, "chat_template", None):
            ids = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
            return [int(i) for i in ids]
        return self.encode(plain_chat_text(messages))


def _generation_eos(folder: Path) -> int | None:
    """eos_token_id of generation_config.json (its first when a list), or None."""
    if not (folder / GENERATION_CONFIG).is_file():
        return None
    try:
        eos = read_json_capped(folder / GENERATION_CONFIG, 1 << 20, "the generation config")[0].get("eos_token_id")
    except (UnreadableFileError, AttributeError):  # unreadable, or not a JSON object
        return None
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None


def load_tokenizer(model_path: str | Path | None, vocab_size: int) -> ByteTokenizer | HfTokenizer:
    """The tokenizer of a Hugging Face folder that has one (tokenizer.json or tokenizer_config.json), else the
    byte tokenizer."""
    if model_path is not None and Path(model_path).is_dir() and \
            any((Path(model_path) / name).is_file() for name in TOKENIZER_FILES):
        return HfTokenizer(model_path, vocab_size)
    return ByteTokenizer(vocab_size)
