"""Just-in-time builds of this folder's kernel sources: the one builder every kernel module uses (docs/design.md
decision 6). Nothing else in zplan.cuda calls torch.utils.cpp_extension.

    _CUDA = JitExtension(Path(__file__).with_name("weight_quant.cu"), cuda=True, cuda_cflags=("-O3",))
    module = _CUDA.load()  # the built module, or None where CUDA is absent or the build failed
    if needs_autograd(x, bias): ...  # the kernels record no gradient: run the pure-torch reference

    # A CPU-only C++ source with SIMD levels, best first; the last needs no CPU feature:
    _CPU = JitExtension(Path(__file__).with_name("cpu_adam.cpp"), cuda=False, cflags=("-O3", "-fopenmp"),
                        ldflags=("-fopenmp",), simd_env="ZPLAN_CPU_ADAM_SIMD", simd=(
                            SimdLevel("avx2", {"avx2", "fma"}, ("-mavx2", "-mfma", "-DZPLAN_AVX2")),
                            SimdLevel("scalar")))

The build name (build_name) is zplan_<stem>[_<variant>]_<12 hex digits>, the digits a hash of the sources' bytes,
the compile and link flags and the torch version, so an edited source, other flags (another SIMD level) or another
torch is built anew, never loaded stale from torch's extension cache; an unchanged one loads from that cache in
~0.1 s. torch.utils.cpp_extension.load builds with ninja: the ninja pip package's binary beside this Python is put
on PATH where PATH has none (a venv that is not activated).

A build is tried once per process and build name, whichever JitExtension asks (a lock keeps two threads from
building it twice). A failed build is remembered: load() returns None after one warning ("<label>: C++|CUDA build
failed (<reason>); using <fallback>"), so the caller keeps its pure-torch reference; load(strict=True) raises
RuntimeError with the reason instead; load(warn=False) returns None silently. Where the source is CUDA and
torch.cuda.is_available() is False nothing is built: None, or RuntimeError when strict.

SIMD: the level is the override in the environment variable simd_env when set, else the first level whose CPU
features (/proc/cpuinfo "flags", x86-64 only) this machine has. An override naming no level, like a source that
cannot be read, is a failed build (ValueError / OSError as the reason).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import sys
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

_LOADED: dict[str, object] = {}  # build name -> the built module, or a _Failed; shared by every JitExtension
_BUILD_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Failed:
    reason: str  # "<exception type>: <last line of its message>"


@dataclass(frozen=True)
class SimdLevel:
    """One SIMD build of a CPU source: its name (the build's variant), the CPU features it needs (/proc/cpuinfo
    flag names) and the compile flags that select it."""

    name: str
    needs: Iterable[str] = frozenset()
    cflags: Iterable[str] = ()

    def __post_init__(self):  # any iterables in, hashable and immutable kept
        object.__setattr__(self, "needs", frozenset(self.needs))
        object.__setattr__(self, "cflags", tuple(self.cflags))


def build_name(sources: Sequence[Path], *, variant: str = "", cflags: Sequence[str] = (),
               cuda_cflags: Sequence[str] = (), ldflags: Sequence[str] = ()) -> str:
    """zplan_<stem of the first source>[_<variant>]_<12 hex digits>: a SHA-256 of each source's bytes (in order),
    the three flag lists and torch's version. Equal inputs give the same name; any changed byte or flag another."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(hashlib.sha256(Path(source).read_bytes()).digest())
    digest.update(json.dumps({"cflags": list(cflags), "cuda_cflags": list(cuda_cflags), "ldflags": list(ldflags),
                              "torch": torch.__version__}).encode())
    stem = Path(sources[0]).stem
    return "_".join(part for part in ("zplan", stem, variant, digest.hexdigest()[:12]) if part)


def put_venv_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the ninja pip package installs it beside this Python, which
    is not on PATH when the venv is not activated (e.g. `.venv/bin/python -m pytest`)."""
    python_bin = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(python_bin, "ninja")):
        os.environ["PATH"] = python_bin + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of this machine, read once (from /proc/cpuinfo; empty where it does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _compile(name: str, sources: Sequence[Path], cflags: Sequence[str], cuda_cflags: Sequence[str],
             ldflags: Sequence[str]):
    """The one call of torch.utils.cpp_extension.load in zplan.cuda."""
    from torch.utils import cpp_extension

    put_venv_ninja_on_path()
    return cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=list(cflags),
                              extra_cuda_cflags=list(cuda_cflags), extra_ldflags=list(ldflags), verbose=False)


class JitExtension:
    """One C++ (.cpp) or CUDA (.cu) extension, built from its source(s) on first use."""

    def __init__(self, sources: Path | Sequence[Path], *, cuda: bool, variant: str = "", cflags: Sequence[str] = (),
                 cuda_cflags: Sequence[str] = (), ldflags: Sequence[str] = (), simd: Sequence[SimdLevel] = (),
                 simd_env: str = "", fallback: str = "the pure-torch reference"):
        self.sources = (sources,) if isinstance(sources, Path) else tuple(Path(s) for s in sources)
        if not self.sources:
            raise ValueError("JitExtension needs at least one source")
        if simd and (cuda or variant):
            raise ValueError("SIMD levels are for CPU sources, and name the variant themselves")
        self.cuda, self.variant, self.fallback = cuda, variant, fallback
        self.cflags, self.cuda_cflags, self.ldflags = tuple(cflags), tuple(cuda_cflags), tuple(ldflags)
        self.simd = {level.name: level for level in simd}
        self.simd_env = simd_env
        self.label = f"zplan.cuda.{self.sources[0].stem}"
        self._names: dict[str, str] = {}  # SIMD level ("" without levels) -> build name, computed once
        self._detected: str | None = None  # detected_simd()

    # --- what is built --------------------------------------------------------------------------------------

    def detected_simd(self) -> str:
        """The first SIMD level whose CPU features this machine has (features count on x86-64 only); found once."""
        if self._detected is None:
            x86 = platform.machine().lower() in ("x86_64", "amd64")
            have = cpu_flags() if x86 else frozenset()
            self._detected = next((level.name for level in self.simd.values() if level.needs <= have),
                                  list(self.simd)[-1])
        return self._detected

    def simd_level(self) -> str:
        """The SIMD level built: the override in simd_env (ValueError when it names no level), else
        detected_simd(); "" for a source without SIMD levels."""
        if not self.simd:
            return ""
        forced = os.environ.get(self.simd_env) if self.simd_env else None
        if forced:
            if forced not in self.simd:
                raise ValueError(f"{self.simd_env}={forced!r}: expected one of {sorted(self.simd)}")
            return forced
        return self.detected_simd()

    def flags(self, simd: str = "") -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """(cflags, cuda_cflags, ldflags) of the build at SIMD level `simd` ("" without levels)."""
        extra = self.simd[simd].cflags if simd else ()
        return self.cflags + extra, self.cuda_cflags, self.ldflags

    def build_name(self, simd: str | None = None) -> str:
        """The build name at SIMD level `simd` (None: simd_level()); reads the sources on every call."""
        simd = self.simd_level() if simd is None else simd
        cflags, cuda_cflags, ldflags = self.flags(simd)
        return build_name(self.sources, variant=simd or self.variant, cflags=cflags, cuda_cflags=cuda_cflags,
                          ldflags=ldflags)

    # --- loading --------------------------------------------------------------------------------------------

    def load(self, strict: bool = False, warn: bool = True):
        """The built module, built on the first call of this process; None where CUDA is needed and absent, or
        the build failed (after a one-line warning unless warn=False). strict=True raises RuntimeError instead of
        returning None."""
        if self.cuda and not torch.cuda.is_available():
            if strict:
                raise RuntimeError(f"{self.label}: CUDA is not available")
            return None
        simd, key, refused = self._resolve()
        entry = _LOADED.get(key)
        if entry is None:
            entry = self._build(key, simd, refused, warn=warn and not strict)
        if isinstance(entry, _Failed):
            if strict:
                raise RuntimeError(f"{self.label}: build failed: {entry.reason}")
            return None
        return entry

    def error(self) -> str:
        """Why the build of the current SIMD level failed; "" when it was not tried or succeeded."""
        entry = _LOADED.get(self._resolve()[1])
        return entry.reason if isinstance(entry, _Failed) else ""

    def tried(self) -> bool:
        """Whether this process has tried to build (or load) the current SIMD level's extension."""
        return self._resolve()[1] in _LOADED

    def _resolve(self) -> tuple[str, str, Exception | None]:
        """(SIMD level, key in _LOADED: the build name, None) or, for a bad override or an unreadable source, ("",
        a key naming the refusal, the exception): a failed build, remembered like one."""
        try:
            simd = self.simd_level()
            return simd, self._names.get(simd) or self._names.setdefault(simd, self.build_name(simd)), None
        except (ValueError, OSError) as exc:
            return "", f"{self.label}:{type(exc).__name__}:{exc}", exc

    def _build(self, key: str, simd: str, refused: Exception | None, warn: bool):
        with _BUILD_LOCK:
            entry = _LOADED.get(key)
            if entry is not None:  # another thread built it meanwhile
                return entry
            try:
                if refused is not None:
                    raise refused
                entry = _compile(key, self.sources, *self.flags(simd))
            except Exception as exc:  # noqa: BLE001 - any build failure: the caller's reference stays in use
                text = str(exc).strip()
                entry = _Failed(f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}")
                if warn:
                    kind = "CUDA" if self.cuda else "C++"
                    warnings.warn(f"{self.label}: {kind} build failed ({entry.reason}); using {self.fallback}",
                                  RuntimeWarning, stacklevel=4)
            _LOADED[key] = entry
            return entry


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """True where autograd would record (grad enabled, a tensor requires grad): the kernels record no gradient,
    so their callers run the pure-torch reference there."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
