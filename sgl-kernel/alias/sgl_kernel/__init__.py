"""``sgl_kernel`` on a CPU-only machine: the name upstream sglang imports, for this fork's ops.

Upstream sglang's CPU path does ``import sgl_kernel`` (and ``from sgl_kernel.mamba import ...``)
and then calls ``torch.ops.sgl_kernel.*_cpu``. The registry has no CPU build of upstream's
sgl-kernel, so on a CPU-only machine this alias stands in for it: the package and each of its
submodules are :mod:`sgl_kernel_fork`'s own objects. It is installed only when torch has no
CUDA build (``sgl-kernel/setup.py``); on a CUDA machine upstream's ``sglang-kernel`` keeps the
name.
"""

import sys

import sgl_kernel_fork as _fork
from sgl_kernel_fork import *  # noqa: F401,F403
from sgl_kernel_fork import __all__, __version__  # noqa: F401

for _name in ("cpu_executor", "mamba", "ops", "speculative"):
    sys.modules[f"{__name__}.{_name}"] = getattr(_fork, _name)
    globals()[_name] = getattr(_fork, _name)
del _name
