"""`import zplan` drops exactly the warning lines importing torchao logs where its CUDA kernels do not load
(transformers imports torchao for every Hugging Face model), and no other record of those loggers."""

from __future__ import annotations

import enum
import logging
import subprocess
import sys

import pytest

from zplan.import_warnings import keep_pytree_record, keep_torchao_record

KERNEL = "/venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"


def record(name: str, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


class TorchaoEnum(enum.Enum):
    A = 1


TorchaoEnum.__module__ = "torchao.float8.config"


def test_only_torchaos_kernel_load_failures_and_enum_deprecations_are_dropped():
    assert not keep_torchao_record(record("torchao", f"Failed to load {KERNEL}: Could not load this library: {KERNEL}"))
    assert not keep_torchao_record(record("torchao", "Failed to load /x/torchao/_C_cutlass_90a.abi3.so: why"))
    assert keep_torchao_record(record("torchao", "Failed to load /x/other_package/_C.so: why"))
    assert keep_torchao_record(record("torchao", "Skipping import of cpp extensions due to incompatible torch version"))
    deprecation = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
                   "Calling register_constant() on Enum subclasses is deprecated")
    assert not keep_pytree_record(record("torch.utils._pytree", deprecation, TorchaoEnum))
    assert keep_pytree_record(record("torch.utils._pytree", deprecation, logging.Formatter))  # not torchao's
    assert keep_pytree_record(record("torch.utils._pytree", "another warning %s", TorchaoEnum))


def stderr_of(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr


def test_importing_torchao_after_zplan_prints_none_of_its_warnings():
    pytest.importorskip("torchao")
    bare = stderr_of("import torchao")
    if "Failed to load" not in bare:
        pytest.skip("torchao's kernel libraries load on this machine: nothing to drop")
    assert "Enum subclass" in bare
    quiet = stderr_of("import zplan, torchao")
    assert "Failed to load" not in quiet and "Enum subclass" not in quiet, quiet
