"""zplan.cuda.jit, the one just-in-time builder of the kernels in cuda/: the build name follows the sources' bytes
and the flags and nothing else; every kernel source of cuda/ is built through it (no other cpp_extension call);
a build is tried once per process; a failure is a warning and the reference, or with strict=True an error. No
compiler runs here: jit._compile is replaced (the real builds: test_cpu_adam.py, test_weight_only_matmul.py)."""

from __future__ import annotations

import ast
import importlib
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

from zplan.cuda import jit

CUDA_DIR = Path(jit.__file__).parent
KERNEL_SOURCES = sorted(p.name for p in CUDA_DIR.iterdir() if p.suffix in (".cu", ".cpp"))
KERNEL_MODULES = sorted(p.stem for p in CUDA_DIR.glob("*.py") if p.stem not in ("__init__", "jit"))


@pytest.fixture
def sources(tmp_path):
    kernel, helper = tmp_path / "kernel.cpp", tmp_path / "helper.cpp"
    kernel.write_bytes(b"int kernel() { return 1; }\n")
    helper.write_bytes(b"int helper() { return 2; }\n")
    return kernel, helper


def test_the_build_name_follows_the_source_bytes(sources, tmp_path):
    kernel, helper = sources
    name = jit.build_name([kernel], cflags=("-O3",))
    assert re.fullmatch(r"zplan_kernel_[0-9a-f]{12}", name)
    assert jit.build_name([kernel], cflags=("-O3",)) == name  # the same inputs: the same name
    os.utime(kernel, (1, 1))  # another mtime, same bytes
    assert jit.build_name([kernel], cflags=("-O3",)) == name
    elsewhere = tmp_path / "copy"
    elsewhere.mkdir()
    shutil.copy(kernel, elsewhere / "kernel.cpp")  # the same bytes at another path
    assert jit.build_name([elsewhere / "kernel.cpp"], cflags=("-O3",)) == name
    kernel.write_bytes(kernel.read_bytes().replace(b"1", b"3"))  # one byte edited
    edited = jit.build_name([kernel], cflags=("-O3",))
    assert edited != name and edited.startswith("zplan_kernel_")
    both = jit.build_name([kernel, helper])
    helper.write_bytes(helper.read_bytes() + b"\n")  # a second source edited
    assert jit.build_name([kernel, helper]) != both


def test_the_build_name_follows_the_flags(sources):
    kernel, _ = sources
    base = dict(cflags=("-O3", "-fopenmp"), cuda_cflags=("-O3",), ldflags=("-fopenmp",))
    name = jit.build_name([kernel], **base)
    assert jit.build_name([kernel], **{k: list(v) for k, v in base.items()}) == name  # lists or tuples alike
    changed = [
        dict(base, cflags=("-O2", "-fopenmp")),
        dict(base, cflags=("-fopenmp", "-O3")),  # order counts for a compiler
        dict(base, cflags=("-O3", "-fopenmp", "-mavx2")),
        dict(base, cuda_cflags=("-O3", "--fmad=false")),
        dict(base, ldflags=()),
        dict(base, cflags=("-O3",), ldflags=("-fopenmp", "-fopenmp")),  # a flag moved from compile to link
    ]
    names = {jit.build_name([kernel], **flags) for flags in changed}
    assert name not in names and len(names) == len(changed)
    variant = jit.build_name([kernel], variant="avx2", **base)
    assert variant.startswith("zplan_kernel_avx2_") and variant[-12:] == name[-12:]  # the variant is a label only


def test_simd_levels_are_builds_of_their_own(sources, monkeypatch):
    kernel, _ = sources
    ext = jit.JitExtension(kernel, cuda=False, cflags=("-O3",), simd_env="ZPLAN_TEST_SIMD", simd=(
        jit.SimdLevel("avx2", {"avx2", "fma"}, ("-mavx2", "-mfma")), jit.SimdLevel("scalar")))
    assert ext.build_name("avx2") == jit.build_name([kernel], variant="avx2", cflags=("-O3", "-mavx2", "-mfma"))
    assert ext.build_name("scalar") == jit.build_name([kernel], variant="scalar", cflags=("-O3",))
    monkeypatch.setenv("ZPLAN_TEST_SIMD", "scalar")
    assert ext.simd_level() == "scalar" and ext.build_name() == ext.build_name("scalar")
    monkeypatch.setenv("ZPLAN_TEST_SIMD", "avx9000")
    with pytest.raises(ValueError, match="ZPLAN_TEST_SIMD='avx9000'"):
        ext.simd_level()
    monkeypatch.delenv("ZPLAN_TEST_SIMD")
    expected = "avx2" if {"avx2", "fma"} <= jit.cpu_flags() and os.uname().machine == "x86_64" else "scalar"
    assert ext.detected_simd() == expected == ext.simd_level()


class FakeModule:
    def simd(self):
        return "fake"


@pytest.fixture
def compiled(monkeypatch):
    """jit._compile recording its calls instead of compiling; no build tried yet in this process; CUDA 'present'."""
    calls = []

    def fake_compile(name, sources, cflags, cuda_cflags, ldflags):
        calls.append((name, tuple(sources), tuple(cflags), tuple(cuda_cflags), tuple(ldflags)))
        return FakeModule()

    monkeypatch.setattr(jit, "_LOADED", {})
    monkeypatch.setattr(jit, "_compile", fake_compile)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for variable in ("ZPLAN_CPU_ADAM_SIMD", "ZPLAN_WOM_SIMD"):
        monkeypatch.delenv(variable, raising=False)
    return calls


def _load_every_kernel():
    loaded = {}
    for stem in KERNEL_MODULES:
        module = importlib.import_module(f"zplan.cuda.{stem}")
        for attr in ("load", "load_cpu", "load_cuda"):
            if callable(getattr(module, attr, None)):
                loaded[f"{stem}.{attr}"] = getattr(module, attr)()
    return loaded


def test_no_kernel_module_builds_on_its_own():
    """Only jit.py names torch.utils.cpp_extension (or a way around it): imports, attributes and names."""
    banned = {"cpp_extension", "load_inline", "BuildExtension", "CppExtension", "CUDAExtension"}
    for stem in KERNEL_MODULES:
        tree = ast.parse((CUDA_DIR / f"{stem}.py").read_text())
        used = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                used |= {node.module or ""} | {alias.name for alias in node.names}
            elif isinstance(node, ast.Import):
                used |= {alias.name for alias in node.names}
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.Name):
                used.add(node.id)
        found = {name for name in used if name.split(".")[-1] in banned or "cpp_extension" in name}
        assert not found, f"cuda/{stem}.py builds outside zplan.cuda.jit: {sorted(found)}"


def test_every_kernel_source_is_built_through_the_builder_once(compiled):
    loaded = _load_every_kernel()
    assert loaded and all(isinstance(module, FakeModule) for module in loaded.values()), loaded
    built = sorted(source.name for _, sources, *_ in compiled for source in sources)
    assert built == KERNEL_SOURCES  # each .cu / .cpp of cuda/ exactly once
    for name, sources, cflags, cuda_cflags, ldflags in compiled:
        assert re.fullmatch(rf"zplan_{sources[0].stem}(_[a-z0-9]+)?_[0-9a-f]{{12}}", name), name
        assert name[-12:] == jit.build_name(sources, cflags=cflags, cuda_cflags=cuda_cflags, ldflags=ldflags)[-12:]
    assert len({name for name, *_ in compiled}) == len(compiled)
    _load_every_kernel()  # loaded once per process: no second build
    assert len(compiled) == len(KERNEL_SOURCES)


def test_two_extensions_of_the_same_build_share_one_load(compiled, sources):
    kernel, _ = sources
    first = jit.JitExtension(kernel, cuda=False, cflags=("-O3",))
    second = jit.JitExtension(kernel, cuda=False, cflags=("-O3",))
    assert first.load() is second.load() and len(compiled) == 1
    assert not jit.JitExtension(kernel, cuda=False, cflags=("-O2",)).tried()
    jit.JitExtension(kernel, cuda=False, cflags=("-O2",)).load()
    assert len(compiled) == 2


def test_a_failed_build_warns_once_or_raises_when_strict(monkeypatch, sources):
    kernel, _ = sources
    calls = []

    def failing_compile(*args):
        calls.append(args)
        raise RuntimeError("Error building extension 'kernel'\nninja: build stopped: subcommand failed.")

    monkeypatch.setattr(jit, "_LOADED", {})
    monkeypatch.setattr(jit, "_compile", failing_compile)
    ext = jit.JitExtension(kernel, cuda=False, fallback="the kernel's reference")
    with pytest.warns(RuntimeWarning, match=r"zplan.cuda.kernel: C\+\+ build failed \(RuntimeError: ninja: build "
                                            r"stopped: subcommand failed.\); using the kernel's reference"):
        assert ext.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: no second warning, no second build
        assert ext.load() is None
        with pytest.raises(RuntimeError, match="zplan.cuda.kernel: build failed: RuntimeError: ninja"):
            ext.load(strict=True)
    assert len(calls) == 1 and ext.tried() and ext.error().startswith("RuntimeError: ninja")

    quiet = jit.JitExtension(kernel, cuda=False, cflags=("-g",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quiet.load(warn=False) is None  # warn=False: silent
        with pytest.raises(RuntimeError, match="build failed"):
            jit.JitExtension(kernel, cuda=False, cflags=("-O1",)).load(strict=True)  # strict: no warning, an error


def test_a_missing_source_is_a_failed_build(monkeypatch, tmp_path):
    monkeypatch.setattr(jit, "_compile", lambda *args: pytest.fail("compiled a missing source"))
    ext = jit.JitExtension(tmp_path / "gone.cpp", cuda=False)
    with pytest.warns(RuntimeWarning, match=r"zplan.cuda.gone: C\+\+ build failed \(FileNotFoundError"):
        assert ext.load() is None
    with pytest.raises(RuntimeError, match="build failed: FileNotFoundError"):
        ext.load(strict=True)
    assert ext.tried() and ext.error().startswith("FileNotFoundError")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_a_cuda_source_is_not_built_without_cuda(monkeypatch, tmp_path):
    source = tmp_path / "kernel.cu"
    source.write_text("// a kernel\n")
    monkeypatch.setattr(jit, "_compile", lambda *args: pytest.fail("built without CUDA"))
    ext = jit.JitExtension(source, cuda=True, cuda_cflags=("-O3",))
    assert ext.load() is None and not ext.tried()
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        ext.load(strict=True)


def test_the_venv_ninja_is_put_on_path(monkeypatch, tmp_path):
    if not (Path(sys.executable).parent / "ninja").exists():
        pytest.skip("no ninja beside this Python")
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without ninja
    jit.put_venv_ninja_on_path()
    assert shutil.which("ninja") == str(Path(sys.executable).parent / "ninja")
