"""Build of the fork's operator package ``sgl_kernel_fork`` (and, on CPU-only machines, its
``sgl_kernel`` alias for upstream sglang).

Install (torch must already be installed; never let pip fetch one)::

    MAX_JOBS=1 pip install --no-build-isolation ./sgl-kernel

Packages:

* ``sgl_kernel_fork`` (``python/sgl_kernel_fork``, always): what this fork's modules import.
* ``sgl_kernel`` (``alias/sgl_kernel``), only when torch has no CUDA build, or when
  SGL_KERNEL_FORK_ALIAS=1 forces it (=0 drops it): the name upstream sglang imports for its CPU
  ops. On a CUDA machine upstream's ``sglang-kernel`` wheel owns that name.

Extensions:

* ``sgl_kernel_fork._C`` (always): the C++ CPU operators in ``csrc/cpu``. Compiled
  for the baseline ISA of the toolchain (no ``-march``); the SIMD kernels in
  ``csrc/cpu/isa`` are compiled once per ISA level (scalar / AVX2 / AVX-512)
  through target pragmas and chosen at run time, so one binary runs on any
  x86-64 and uses AVX-512 where present.
* ``sgl_kernel_fork._C_cuda`` (only when ``csrc/cuda/*.cu`` exist, torch was built
  with CUDA and a CUDA toolkit is found, or SGL_KERNEL_BUILD_CUDA=1 forces
  it): the CUDA sources, compiled with nvcc. SGL_KERNEL_BUILD_CUDA=0 skips it.
"""

import glob
import os

from setuptools import setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


cpu_sources = rel(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))
cpu_sources += rel(glob.glob(os.path.join(ROOT, "csrc", "cpu", "isa", "*.cpp")))

cxx_flags = [
    "-O3",
    "-g0",  # overrides the -g of Python's CFLAGS: much faster compile, smaller .so
    "-std=c++20",  # torch 2.13's headers are C++20
    "-fopenmp",  # at::parallel_for is header-inlined: needs OpenMP to run in parallel
    "-fno-math-errno",
    "-Wall",
    "-Wno-unused-function",
]

ext_modules = [
    CppExtension(
        name="sgl_kernel_fork._C",
        sources=cpu_sources,
        include_dirs=[os.path.join(ROOT, "csrc", "cpu")],
        extra_compile_args={"cxx": cxx_flags},
        # links the libgomp torch already loaded (same soname), not a second runtime
        extra_link_args=["-fopenmp"],
    )
]


def want_cuda(cuda_sources):
    flag = os.environ.get("SGL_KERNEL_BUILD_CUDA", "auto").lower()
    if flag in ("0", "false", "no", "off"):
        return False
    if not cuda_sources:
        if flag in ("1", "true", "yes", "on"):
            print("sgl-kernel: SGL_KERNEL_BUILD_CUDA set but csrc/cuda has no .cu file")
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    have = torch.version.cuda is not None and CUDA_HOME is not None
    if flag in ("1", "true", "yes", "on") and not have:
        raise RuntimeError(
            "SGL_KERNEL_BUILD_CUDA=1 but torch has no CUDA build "
            f"(torch.version.cuda={torch.version.cuda}) or no CUDA toolkit was found"
        )
    if not have:
        print(
            "sgl-kernel: skipping csrc/cuda (torch.version.cuda="
            f"{torch.version.cuda}, CUDA_HOME={CUDA_HOME})"
        )
    return have


cuda_sources = rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
if want_cuda(cuda_sources):
    from torch.utils.cpp_extension import CUDAExtension

    cuda_sources += rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cpp")))
    ext_modules.append(
        CUDAExtension(
            name="sgl_kernel_fork._C_cuda",
            sources=cuda_sources,
            include_dirs=[os.path.join(ROOT, "csrc", "cuda")],
            extra_compile_args={
                "cxx": ["-O3", "-g0", "-std=c++20"],
                "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr"],
            },
        )
    )


def want_alias():
    flag = os.environ.get("SGL_KERNEL_FORK_ALIAS", "auto").lower()
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("1", "true", "yes", "on"):
        return True
    return torch.version.cuda is None


package_dir = {"sgl_kernel_fork": "python/sgl_kernel_fork"}
if want_alias():
    package_dir["sgl_kernel"] = "alias/sgl_kernel"

setup(
    name="sgl-kernel-fork",
    version="0.1.0",
    description="The fork's operators (torch.ops.sgl_kernel namespace): expert-slot cache, CPU "
    "expert executor, and the CPU ops upstream sglang needs on CPU-only machines",
    package_dir=package_dir,
    packages=list(package_dir),
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    zip_safe=False,
)
