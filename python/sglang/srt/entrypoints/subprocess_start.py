"""How the launcher starts its scheduler and detokenizer processes: fork on a CPU server.

Upstream (``entrypoints/engine.py`` ``_set_envs_and_config``) always uses ``spawn``, which a
CUDA launcher needs: a CUDA context does not survive ``fork``. Each spawned child then imports
SGLang, torch and transformers again, about 10 s of CPU per child on a small machine, while the
launcher has already imported all of it (``engine.py`` imports ``run_scheduler_process`` at
module level). A server on ``--device cpu`` has no CUDA context, and the launcher starts these
children before it runs any tensor op, so they can be forked and share its imports
(copy-on-write), and a small machine's server is ready much sooner (figures in
``benchmark/RESULTS.md``, "Server start"; tested by ``test/entrypoints/test_subprocess_start.py``
and ``test/e2e/test_launcher_fork.py``). vLLM makes the same choice
(``VLLM_WORKER_MULTIPROC_METHOD`` is ``fork`` unless CUDA was initialized).

Fork is chosen only where it is safe:
- in the ``python -m sglang.launch_server`` process itself, single-threaded: an ``sgl.Engine``
  inside a user's program gets spawn, since that program may hold threads or have run torch's
  OpenMP runtime (libgomp), which does not survive a fork once it ran a parallel region (the
  forked child hangs in its first one);
- with no CUDA device visible and no ``--numa-node`` (upstream's numactl wrapper,
  ``utils/numa_utils.py``, works only with spawn).
Only the launch forks: the launcher returns to spawn once the detokenizer runs
(:func:`restore_spawn`), and every forked child starts its own children by spawn with default
SIGQUIT handling (``os.register_at_fork``), since the scheduler runs the model. One difference
stays: a forked child leaves by ``os._exit``, so ``atexit`` handlers registered in it do not run
at a normal exit (spawned ones run them); those upstream registers there (HiCache storage
shutdown, KV events, final pool statistics) are not used by a CPU server without HiCache.

``SGLANG_SUBPROCESS_START_METHOD`` (``fork`` or ``spawn``) overrides the choice.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import threading

logger = logging.getLogger(__name__)

ENV = "SGLANG_SUBPROCESS_START_METHOD"
METHODS = ("fork", "spawn")
LAUNCHER_MODULE = "sglang.launch_server"
_reset_registered = False


def _main_module() -> str | None:
    """The module run as ``__main__`` (``python -m NAME``), or None."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None)


def _thread_count() -> int:
    """Python threads alive in this process (``threading.active_count``)."""
    return threading.active_count()


def subprocess_start_method(device: str | None, numa_node=None) -> str:
    """The start method for the launcher's children.

    Args:
        device: the resolved ``ServerArgs.device``.
        numa_node: ``ServerArgs.numa_node`` (a list of nodes, or None).

    Returns:
        ``ENV``'s value when set; else ``"fork"`` when every condition of the module docstring
        holds (``device == "cpu"``, the ``sglang.launch_server`` process with one thread, no
        CUDA device visible, no ``numa_node``), else ``"spawn"`` (upstream's).

    Raises:
        ValueError: ``ENV`` is set to something other than ``fork`` or ``spawn``.
    """
    forced = os.environ.get(ENV, "").strip()
    if forced:
        if forced not in METHODS:
            raise ValueError(f"{ENV}={forced!r}: use one of {', '.join(METHODS)} (or unset it)")
        return forced
    if device != "cpu" or numa_node is not None:
        return "spawn"
    if _main_module() != LAUNCHER_MODULE or _thread_count() > 1:
        return "spawn"
    import torch

    return "spawn" if torch.cuda.is_available() else "fork"


def _forked_child() -> None:
    mp.set_start_method("spawn", force=True)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)  # not the launcher's tree-killing handler


def set_subprocess_start_method(device: str | None, numa_node=None) -> str:
    """Set multiprocessing's start method for the launch (see the module docstring) and, when
    it forks, make every forked child start its own children by ``spawn``. Returns the method.

    Raises:
        ValueError: as :func:`subprocess_start_method`.
    """
    global _reset_registered
    method = subprocess_start_method(device, numa_node)
    mp.set_start_method(method, force=True)
    if method == "fork":
        if not _reset_registered:
            os.register_at_fork(after_in_child=_forked_child)
            _reset_registered = True
        logger.info(
            "Scheduler and detokenizer processes are forked from the launcher (CPU server: they "
            "share its imports); %s=spawn starts them as upstream does",
            ENV,
        )
    return method


def restore_spawn() -> None:
    """Back to upstream's ``spawn`` once the launcher's children run: whatever this process
    starts later (it has run tensor ops by then) does not fork."""
    mp.set_start_method("spawn", force=True)
