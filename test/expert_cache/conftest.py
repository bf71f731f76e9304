"""Shared setup of the expert-cache tests.

The tests need this checkout's ``sgl_kernel_fork`` and its modules installed in the venv (``make
setup``, which links ``python/sglang/srt/layers/moe/expert_cache/`` into the installed ``sglang``
package); if ``sgl_kernel_fork`` cannot be imported the folder fails (no silent skip).
"""

try:
    import sgl_kernel_fork  # noqa: F401
except ImportError as e:  # pragma: no cover - reported as a collection error
    raise ImportError(
        "sgl_kernel_fork is not importable: build and install it with `make setup` (" + str(e) + ")"
    ) from e
