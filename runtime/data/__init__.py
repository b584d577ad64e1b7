"""Training data from files: token files (token_file.py), text, JSON lines and Hugging Face datasets tokenized with a
local tokenizer (documents.py, tokenizer.py), packed into sequences (packing.py), visited in a seeded order and
sharded over data-parallel ranks (batches.py), opened and checked for a run (source.py), its position recorded in
checkpoints (position.py), and `zplan data prepare` (prepare.py)."""
