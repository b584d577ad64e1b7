"""Drop the four warning lines importing torchao 0.18 logs on a machine where its CUDA kernels do not load.

zplan imports torchao only for fp8 and nvfp4 runs (runtime.precision.float8, runtime.precision.nvfp4, inside functions),
but transformers imports it whenever it is installed (transformers/quantizers/quantizer_torchao.py, at import), so every
start that builds a Hugging Face model printed them, once per process (each rank of a train.py):
- torchao/__init__.py, logger "torchao": "Failed to load .../torchao/_C_mxfp8...so: ..." and the same for
  _C_cutlass_90a.abi3.so (its MXFP8 and SM90a CUTLASS kernels, which zplan never calls: its fp8 and NVFP4 GEMMs
  are torch._scaled_mm or torchao's emulation);
- torch/utils/_pytree.py, logger "torch.utils._pytree": "<enum 'KernelPreference'> is an Enum subclass and is
  now natively supported by torch.compile ..." and the same for ScaleCalculationMode (torchao registers its enums
  as pytree constants, which torch 2.13 deprecates).
Each filter drops exactly those records on the logger that makes them; every other record of both loggers passes.
Installing them imports nothing (logging filters on named loggers), so `import zplan` does it, before any model
file runs.
"""

from __future__ import annotations

import logging
import re

# "Failed to load <torchao's folder>/_C<name>.so: <why>", as torchao/__init__.py logs a kernel library it cannot load
TORCHAO_KERNEL_LOAD_FAILURE = re.compile(r"Failed to load \S*torchao[/\\]_C[^/\\\s]*\.so: ")
PYTREE_ENUM_DEPRECATION = "%s is an Enum subclass and is now natively supported by torch.compile"


def keep_torchao_record(record: logging.LogRecord) -> bool:
    """False for torchao's 'Failed to load' line of one of its own _C*.so kernel libraries."""
    return not TORCHAO_KERNEL_LOAD_FAILURE.match(record.getMessage())


def keep_pytree_record(record: logging.LogRecord) -> bool:
    """False for torch's deprecation of register_constant on an Enum when the Enum is torchao's."""
    if not str(record.msg).startswith(PYTREE_ENUM_DEPRECATION) or not record.args:
        return True
    enum = record.args[0] if isinstance(record.args, tuple) else record.args
    return not getattr(enum, "__module__", "").startswith("torchao")


def drop_torchao_import_warnings() -> None:
    """Install both filters (again: no change; logging keeps one of each)."""
    logging.getLogger("torchao").addFilter(keep_torchao_record)
    logging.getLogger("torch.utils._pytree").addFilter(keep_pytree_record)
