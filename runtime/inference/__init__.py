"""Inference runtime: the engine (KV cache, sampling, tensor parallel, weight-only INT8/INT4), ZeRO-Inference
weight streaming, the byte tokenizer and the HTTP server behind the emitted generate.py and serve.py."""
