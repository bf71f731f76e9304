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

The one hazard: torch's OpenMP runtime (libgomp) does not survive a fork once it has run a
parallel region; a forked child would hang in its first one. The launcher has run none when it
forks, but the scheduler runs the model, so every forked child is reset to ``spawn`` for any
process it starts itself (``os.register_at_fork``).

``SGLANG_SUBPROCESS_START_METHOD`` (``fork``, ``spawn`` or ``forkserver``) overrides the choice.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os

logger = logging.getLogger(__name__)

ENV = "SGLANG_SUBPROCESS_START_METHOD"
METHODS = ("fork", "spawn", "forkserver")
_reset_registered = False


def subprocess_start_method(device: str | None) -> str:
    """The start method for the launcher's children on ``device`` (``ServerArgs.device``).

    Returns:
        ``ENV``'s value when set; else ``"fork"`` for ``device == "cpu"`` when this process has
        no CUDA context (``torch.cuda.is_initialized()`` false), else ``"spawn"`` (upstream's).

    Raises:
        ValueError: ``ENV`` is set to something other than ``fork``, ``spawn``, ``forkserver``.
    """
    forced = os.environ.get(ENV, "").strip()
    if forced:
        if forced not in METHODS:
            raise ValueError(f"{ENV}={forced!r}: use one of {', '.join(METHODS)} (or unset it)")
        return forced
    if device != "cpu":
        return "spawn"
    import torch

    return "spawn" if torch.cuda.is_initialized() else "fork"


def _children_spawn() -> None:
    mp.set_start_method("spawn", force=True)


def set_subprocess_start_method(device: str | None) -> str:
    """Set multiprocessing's start method for the launcher (see the module docstring) and, when
    it forks, make every forked child start its own children by ``spawn``. Returns the method.

    Raises:
        ValueError: as :func:`subprocess_start_method`.
    """
    global _reset_registered
    method = subprocess_start_method(device)
    mp.set_start_method(method, force=True)
    if method == "fork":
        if not _reset_registered:
            os.register_at_fork(after_in_child=_children_spawn)
            _reset_registered = True
        logger.info(
            "Scheduler and detokenizer processes are forked from the launcher (CPU server: they "
            "share its imports); %s=spawn starts them as upstream does",
            ENV,
        )
    return method
