"""Pack a model's routed experts into the host pool's bank layout (FreeToken §4.2).

    python -m sglang.srt.layers.moe.expert_cache.pack --model-path M [--output PATH]

The packer builds the pool exactly as a server with ``--enable-expert-cache`` does: it builds
the model with upstream's own loader on the CPU (``get_model``, the model's ``load_weights``
and ``FusedMoE``'s weight loaders writing every expert into the pool, :mod:`method`), then
writes the pool's MoE-layer rows bank by bank (:func:`pack_io.write_pack`: aligned slabs,
per-chunk checksums, atomic). So the pack holds, byte for byte, the pool a server builds from
the checkpoint, for every format ``banks.py`` knows, with no per-format code here. Peak
memory: the model plus the pool, as for a server.

The default output is ``<model folder>/sglang-expert-pool.pack``, where servers look for it
(``SGLANG_EXPERT_CACHE_PACK`` names another path). Exit status 0 on success; 2 with a message
for a model the expert cache does not serve.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

if __name__ == "__main__" and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
    # The pool is built on the CPU; upstream reads this variable when its modules are first
    # imported, so restart with it set before importing them.
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]], env)

from sglang.srt.layers.moe.expert_cache import pack_format as fmt  # noqa: E402
from sglang.srt.layers.moe.expert_cache import pack_io  # noqa: E402

logger = logging.getLogger(__name__)


def start_single_process_group() -> None:
    """A world of one process (gloo) and upstream's model-parallel groups over it (once)."""
    import torch.distributed

    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    if torch.distributed.is_initialized():
        return

    env = dict(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    for k, v in env.items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    initialize_model_parallel(backend="gloo")


def load_pool(model_path: str, dtype: str = "auto", use_pack: bool = False):
    """Build ``model_path`` on the CPU (``SGLANG_USE_CPU_ENGINE=1`` must be set before
    sglang is imported) with the expert cache on, from its checkpoint (or, with
    ``use_pack``, from a pack where the server would use one), and return the process's
    :class:`ExpertSlotCache` (its ``host`` is the filled pool) and the model.

    Raises:
        RuntimeError: the expert cache does not serve this model (``make_for_layer``'s
            message), or the model has no MoE layer.
    """
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp
    from sglang.srt.layers.moe.expert_cache.method import (
        get_expert_slot_cache,
        reset_expert_slot_cache,
    )
    from sglang.srt.model_loader import get_model
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    if not use_pack:
        os.environ[fmt.PACK_ENV] = "off"  # pack from the checkpoint, never from an old pack
    elif os.environ.get(fmt.PACK_ENV) == "off":
        del os.environ[fmt.PACK_ENV]  # set by an earlier load_pool of this process
    args = ServerArgs(
        model_path=model_path,
        device="cpu",
        dtype=dtype,
        tp_size=1,
        attention_backend="torch_native",
        enable_expert_cache=True,
        expert_cache_size="auto",  # 0 slots on the CPU: nothing but the pool is built
        expert_cache_fill_gbps=1.0,  # fixed, so nothing is measured
        expert_cache_cpu_gbps=1.0,
    )
    import torch.distributed

    if not torch.distributed.is_initialized():  # once per process (later loads reuse it)
        reset_context()
        publish(args, role="test", ranks=SpawnRanks(world_rank=0))
        start_single_process_group()
    reset_expert_slot_cache()
    load_config = LoadConfig(load_format=args.load_format, download_dir=args.download_dir)
    # as upstream's ModelRunner.load_model does on the CPU before get_model: it records the
    # original head counts some loaders read (mllama4's q/k permutation)
    model_config = adjust_config_with_unaligned_cpu_tp(
        ModelConfig.from_server_args(args), load_config, tp_size=1
    )
    model = get_model(
        model_config=model_config,
        load_config=load_config,
        device_config=DeviceConfig("cpu"),
    )
    cache = get_expert_slot_cache()
    if cache is None or not cache.layer_ids:
        raise RuntimeError(f"{model_path} has no MoE layer served by the expert cache")
    return cache, model


def pack_model(
    model_path: str, output: Optional[os.PathLike] = None, progress: bool = True
) -> Path:
    """Pack ``model_path`` (a local model folder) to ``output`` (default: in the folder).

    Returns:
        the pack's path.

    Raises:
        FileNotFoundError: ``model_path`` is not a local folder with a config and weights.
        RuntimeError: the expert cache does not serve this model.
    """
    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_path} is not a local model folder with a config.json (download the "
            "model first, e.g. `huggingface-cli download ...`, and pass its folder)"
        )
    identity = fmt.model_identity(folder)  # before loading: the files the pool comes from
    t0 = time.perf_counter()
    cache, _ = load_pool(str(folder))
    t1 = time.perf_counter()
    out = Path(output) if output else folder / fmt.PACK_FILE
    pack_io.write_pack(
        out, cache.host, cache.num_experts, sorted(cache.layer_ids), identity, progress
    )
    nbytes = cache.host.expert_bytes * cache.pool_experts
    logger.info(
        "Packed %d experts (%.2f GB, format %s) into %s: checkpoint load %.1f s, write %.1f s",
        cache.pool_experts,
        nbytes / 1e9,
        cache.host.format.label,
        out,
        t1 - t0,
        time.perf_counter() - t1,
    )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang.srt.layers.moe.expert_cache.pack", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model-path", required=True, help="local model folder")
    parser.add_argument(
        "--output", help=f"pack file (default: <model-path>/{fmt.PACK_FILE}, where servers look)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = pack_model(a.model_path, a.output, progress=not a.no_progress)
    except (FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
