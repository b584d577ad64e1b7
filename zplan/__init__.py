"""zplan: plan 3D-parallel + ZeRO training, prove it fits, emit the program that runs it."""

__version__ = "0.1.0"
