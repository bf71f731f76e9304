"""The CUDA sources compile here even without a GPU or a CUDA build of torch.

* ``csrc/cuda/expert_cache.cu`` (kernels + plain launchers, no torch headers) with nvcc
  (``-std=c++17 -arch=sm_90``);
* ``csrc/cuda/expert_cache_binding.cpp`` (torch binding) with the host C++ compiler, torch's
  headers and the CUDA toolkit's headers, as setup.py's CUDAExtension would compile it; then the
  launchers the binding calls must be the ones the kernel object defines;
* ``csrc/cuda/cpu_branch_binding.cpp`` (the CPU branch as copies + a host function on a stream)
  the same way.

Skipped, with the reason, when nvcc / a C++ compiler / the headers are missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "sgl-kernel" / "csrc"
CUDA_DIR = CSRC / "cuda"


def _nvcc():
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def _cuda_include(nvcc):
    for root in (Path(nvcc).resolve().parent.parent, Path("/usr/local/cuda")):
        if (root / "include" / "cuda_runtime.h").exists():
            return root / "include"
    return None


def _run(cmd):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600)


def _symbols(obj):
    """(defined text symbols, undefined symbols) of an object file, demangled; None without nm."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    defined, undefined = set(), set()
    for line in _run([nm, "-C", obj]).stdout.splitlines():
        m = re.match(r"^\s*(?:[0-9a-fA-F]+\s+)?([TU])\s+(.*)$", line)
        if m:
            (defined if m.group(1) == "T" else undefined).add(m.group(2).strip())
    return defined, undefined


@pytest.fixture(scope="module")
def kernel_object(tmp_path_factory):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("nvcc") / "expert_cache.o"
    r = _run(
        [
            nvcc,
            "-c",
            "-std=c++17",
            "-arch=sm_90",
            "-O3",
            f"-I{CSRC}",
            CUDA_DIR / "expert_cache.cu",
            "-o",
            out,
        ]
    )
    assert r.returncode == 0, f"nvcc failed:\n{r.stdout}\n{r.stderr}"
    return out


def test_kernels_compile_with_nvcc(kernel_object):
    assert kernel_object.stat().st_size > 0


def test_binding_compiles_against_torch_and_cuda_headers(kernel_object, tmp_path):
    pytest.importorskip("torch")
    from torch.utils.cpp_extension import include_paths

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    cuda_inc = _cuda_include(_nvcc())
    if cuda_inc is None:
        pytest.skip("CUDA toolkit headers (cuda_runtime.h) not found")
    incs = include_paths()
    if not any((Path(p) / "c10" / "cuda" / "CUDAStream.h").exists() for p in incs):
        pytest.skip("this torch ships no c10/cuda headers")
    # CPU wheels lack the one generated c10/cuda header; an empty stand-in suffices to compile.
    stub = tmp_path / "stub"
    if not any((Path(p) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists() for p in incs):
        (stub / "c10" / "cuda" / "impl").mkdir(parents=True)
        (stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text("#pragma once\n")
    obj = tmp_path / "binding.o"
    cmd = [cxx, "-c", "-std=c++20", "-O0", "-fPIC", "-Wall", "-DTORCH_EXTENSION_NAME=_C_cuda"]
    cmd += [f"-I{p}" for p in incs] + [f"-I{stub}", f"-I{cuda_inc}", f"-I{CUDA_DIR}", f"-I{CSRC}"]
    r = _run(cmd + [CUDA_DIR / "expert_cache_binding.cpp", "-o", obj])
    assert r.returncode == 0, f"binding failed to compile:\n{r.stderr[-4000:]}"
    r = _run(
        [
            cxx,
            "-c",
            "-fPIC",
            f"-I{sysconfig.get_paths()['include']}",
            CUDA_DIR / "python_module.cpp",
            "-o",
            tmp_path / "module.o",
        ]
    )
    assert r.returncode == 0, f"python_module.cpp failed to compile:\n{r.stderr[-4000:]}"
    syms = _symbols(obj), _symbols(kernel_object)
    if None in syms:
        return
    (_, needed), (defined, _) = syms
    wanted = {s for s in needed if s.startswith("sglk_cuda::launch_")}
    assert wanted, "the binding calls no launcher"
    assert wanted <= defined, f"launchers missing from the kernel object: {wanted - defined}"


def test_cpu_branch_binding_compiles_against_torch_and_cuda_headers(tmp_path):
    """The graph-capturable CPU branch (``moe_experts_cpu_enqueue``): copies and a host function
    on the current stream, the executor reached through the dispatcher."""
    pytest.importorskip("torch")
    from torch.utils.cpp_extension import include_paths

    nvcc = _nvcc()
    cxx = shutil.which("c++") or shutil.which("g++")
    if nvcc is None or cxx is None:
        pytest.skip("nvcc or a C++ compiler not found")
    cuda_inc = _cuda_include(nvcc)
    incs = include_paths()
    if cuda_inc is None or not any(
        (Path(p) / "c10" / "cuda" / "CUDAStream.h").exists() for p in incs
    ):
        pytest.skip("CUDA toolkit headers or torch's c10/cuda headers not found")
    stub = tmp_path / "stub"
    if not any((Path(p) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists() for p in incs):
        (stub / "c10" / "cuda" / "impl").mkdir(parents=True)
        (stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cmd = [
        cxx,
        "-c",
        "-std=c++20",
        "-O0",
        "-fPIC",
        "-Wall",
        "-Werror",
        "-DTORCH_EXTENSION_NAME=_C_cuda",
    ]
    cmd += [f"-I{p}" for p in incs] + [f"-I{stub}", f"-I{cuda_inc}", f"-I{CUDA_DIR}", f"-I{CSRC}"]
    obj = tmp_path / "cpu_branch.o"
    r = _run(cmd + [CUDA_DIR / "cpu_branch_binding.cpp", "-o", obj])
    assert r.returncode == 0, f"cpu_branch_binding.cpp failed to compile:\n{r.stderr[-4000:]}"
    syms = _symbols(obj)
    if syms is not None:
        _, undefined = syms
        assert any("cudaLaunchHostFunc" in u for u in undefined), "no host function launched"
