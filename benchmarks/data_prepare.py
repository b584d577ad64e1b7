"""`zplan data prepare`'s tokens/s against the tokenizer's own batch API on the same text, in the same process.

    python benchmarks/data_prepare.py [--mb 20] [--vocab 8000]

A byte-level BPE tokenizer is trained here on generated text (nothing is downloaded) and saved as save_pretrained
writes it; the text (`--mb` MB, one document per line) is then tokenized (1) by the Rust tokenizer's encode_batch over
all its lines at once, ids only, nothing written: the baseline, and (2) by zplan.runtime.data.prepare, which reads the
file, encodes batches of documents with the same API, joins them with the separator and writes the token file and its
sidecar. Each is run `--repeats` times, alternating; the medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from zplan.runtime.data.prepare import prepare

WORDS = 5000  # distinct made-up words of 2-9 letters, Zipf-distributed


def make_text(path: Path, megabytes: float, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(WORDS)]
    weights = [1.0 / (rank + 1) for rank in range(WORDS)]
    lines, size = [], 0
    while size < megabytes * 1e6:
        line = " ".join(rng.choices(words, weights, k=rng.randint(20, 200))) + "."
        lines.append(line)
        size += len(line) + 1
    path.write_text("\n".join(lines) + "\n")
    return lines


def make_tokenizer(folder: Path, lines: list[str], vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # optional dependency: tokenizers
    from transformers import PreTrainedTokenizerFast  # optional dependency: transformers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines[:2000], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=20.0, help="megabytes of text (default 20)")
    parser.add_argument("--vocab", type=int, default=8000, help="BPE vocabulary (default 8000)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoTokenizer  # optional dependency: transformers

    with tempfile.TemporaryDirectory() as tmp:
        folder, text = Path(tmp), Path(tmp) / "corpus.txt"
        lines = make_text(text, args.mb)
        make_tokenizer(folder / "tok", lines, args.vocab)
        backend = AutoTokenizer.from_pretrained(str(folder / "tok"), local_files_only=True).backend_tokenizer
        baseline_s, zplan_s, tokens = [], [], 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            encoded = backend.encode_batch(text.read_text().splitlines(), add_special_tokens=False)
            baseline_s.append(time.perf_counter() - start)
            tokens = sum(len(e.ids) for e in encoded) + len(encoded)  # + one separator per document, as prepare
            del encoded
            start = time.perf_counter()
            done = prepare([text], folder / "tok", folder / "tokens.bin")
            zplan_s.append(time.perf_counter() - start)
            assert done.tokens == tokens, (done.tokens, tokens)
    base, ours = statistics.median(baseline_s), statistics.median(zplan_s)
    print(f"{args.mb:g} MB of text, {tokens:,} tokens, {os.cpu_count()} cores")
    print(f"tokenizer encode_batch (baseline): {tokens / base:,.0f} tokens/s ({base:.2f} s)")
    print(f"zplan data prepare:                {tokens / ours:,.0f} tokens/s ({ours:.2f} s)")
    print(f"ratio zplan / baseline: {base / ours:.2f}")


if __name__ == "__main__":
    main()
