"""The benchmarks' model: examples/gpt.py at 4 layers, hidden 256, 4 heads, vocabulary 8192, 64 tokens.

5.3M parameters (3.2M in the blocks, 2.1M in the tied embedding and head, 16k in positions): large
enough that a step on one core is mostly GEMMs (about 0.15 s for 2 sequences of 64 tokens), small
enough that a benchmark of a dozen configurations fits in a few minutes on 2 cores. No train_data hook: the runtime's
synthetic token sequences are the data. zplan compiles it like any model file:

    .venv/bin/python -m zplan compile benchmarks/_small_gpt.py --gpus 2 --cluster cpu-local --precision fp32
"""

from zplan.examples.gpt import build_model as build_gpt

NUM_LAYERS = 4
HIDDEN = 256
HEADS = 4
VOCAB_SIZE = 8192
SEQ_LEN = 64


def build_model(num_layers: int = NUM_LAYERS, hidden: int = HIDDEN, heads: int = HEADS,
                vocab_size: int = VOCAB_SIZE, max_seq_len: int = SEQ_LEN):
    return build_gpt(num_layers=num_layers, hidden=hidden, heads=heads, vocab_size=vocab_size,
                     max_seq_len=max_seq_len)
