"""Shared setup of the expert-cache tests.

The tests need this checkout's ``sgl_kernel_fork`` installed (``make setup``) or built in place
(``cd sgl-kernel && python setup.py build_ext --inplace``, then ``PYTHONPATH=sgl-kernel/python``);
if it cannot be imported the folder fails (no silent skip). The modules under test
(``python/sglang/srt/layers/moe/expert_cache/{reference,control}.py``) are loaded from this
checkout by file path (see ``ec_util.py``), so the tests do not depend on how the installed
``sglang`` package links them.
"""

try:
    import sgl_kernel_fork  # noqa: F401
except ImportError as e:  # pragma: no cover - reported as a collection error
    raise ImportError(
        "sgl_kernel_fork is not importable: build it in place (cd sgl-kernel && python setup.py "
        "build_ext --inplace) and put sgl-kernel/python on PYTHONPATH (" + str(e) + ")"
    ) from e
