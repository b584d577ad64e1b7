"""Compression: gradients on the data-parallel path (grad_compression.py) and model weights
(quantized_weights.py), with the quantizers' pure-torch references in zplan.cuda."""
