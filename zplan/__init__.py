"""zplan: plan 3D-parallel + ZeRO training, prove it fits, emit the program that runs it."""

from zplan.import_warnings import drop_torchao_import_warnings

__version__ = "0.1.0"

drop_torchao_import_warnings()  # before any model file imports transformers, which imports torchao (import_warnings)
