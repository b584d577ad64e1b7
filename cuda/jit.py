"""Just-in-time builds of this folder's kernel sources (DESIGN.md decision 6).

    _CUDA = JitExtension(Path(__file__).with_name("weight_quant.cu"), cuda=True, cuda_cflags=("-O3",))
    module = _CUDA.load()  # the built module, or None where CUDA is absent or the build failed
    if needs_autograd(x, bias): ...  # the kernels record no gradient: run the pure-torch reference

torch.utils.cpp_extension.load builds the source once per content and flags (the extension's name carries their
hash, so an edited source is rebuilt, not loaded stale) and caches the result. A failed build is remembered: the
caller keeps its pure-torch reference after one warning, or with strict=True gets a RuntimeError that says why.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import torch


class JitExtension:
    """One C++ (.cpp) or CUDA (.cu) source built on first use."""

    def __init__(self, source: Path, *, cuda: bool, variant: str = "", cflags: tuple[str, ...] = (),
                 cuda_cflags: tuple[str, ...] = (), ldflags: tuple[str, ...] = ()):
        self.source, self.cuda, self.variant = source, cuda, variant
        self.cflags, self.cuda_cflags, self.ldflags = list(cflags), list(cuda_cflags), list(ldflags)
        self.label = f"zplan.cuda.{source.stem}"
        self._module = None  # the built module; False once its build failed
        self._error = ""

    def build_name(self) -> str:
        """zplan_<stem>[_<variant>]_<12 hex digits of the source and flags>."""
        flags = " ".join(self.cflags + self.cuda_cflags + self.ldflags)
        digest = hashlib.sha256(self.source.read_bytes() + flags.encode()).hexdigest()[:12]
        return "_".join(part for part in ("zplan", self.source.stem, self.variant, digest) if part)

    def load(self, strict: bool = False, warn: bool = True):
        """The built module; None where CUDA is needed and absent, or the build failed (after a one-line warning
        unless warn=False). strict=True raises RuntimeError instead of returning None."""
        if self.cuda and not torch.cuda.is_available():
            if strict:
                raise RuntimeError(f"{self.label}: CUDA is not available")
            return None
        if self._module is None:
            try:
                from torch.utils import cpp_extension

                from zplan.cuda.cpu_adam import _put_venv_ninja_on_path

                _put_venv_ninja_on_path()
                self._module = cpp_extension.load(
                    name=self.build_name(), sources=[str(self.source)], extra_cflags=self.cflags,
                    extra_cuda_cflags=self.cuda_cflags, extra_ldflags=self.ldflags, verbose=False)
            except Exception as exc:  # noqa: BLE001 - any build failure: the caller's reference stays in use
                self._module = False
                text = str(exc).strip()
                self._error = f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"
                if warn and not strict:
                    warnings.warn(f"{self.label}: build failed ({self._error}); using the pure-torch reference",
                                  RuntimeWarning, stacklevel=3)
        if self._module is False and strict:
            raise RuntimeError(f"{self.label}: build failed: {self._error}")
        return self._module or None


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """True where autograd would record (grad enabled, a tensor requires grad): the kernels record no gradient,
    so their callers run the pure-torch reference there."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
