"""Server start from a packed expert pool (FreeToken §3.3 "Fast engine bootstrap", §4.2).

Patch ``0050-expert-cache-pack-load`` calls :func:`with_expert_pack` from upstream's
``DefaultModelLoader.load_weights_and_postprocess`` (both load paths: the serial one and the
startup-overlap one) with the checkpoint's weight stream, after the model, and so the host pool,
has been built. With ``--enable-expert-cache`` and a pack at ``SGLANG_EXPERT_CACHE_PACK`` (a
path; ``off`` disables packs) or else ``<model folder>/sglang-expert-pool.pack``:

1. the header is checked against the model folder (identity) and the pool the server built
   (format, banks, shapes, MoE layers); any mismatch, another version, a truncated file or a
   corrupt header refuses the pack with a warning that names every problem and the command
   that repacks, and the ordinary checkpoint load runs;
2. reader threads fill the host banks from the pack (:func:`pack_io.read_pack`: ``O_DIRECT``,
   checksums verified in the reader threads) while the weight stream goes on with every
   tensor but the routed experts of the cache's layers (checkpoint names
   ``layers.<l>. ... .experts.<e>.``). Upstream's safetensors iterators map the files, so a
   skipped tensor's bytes are never read (with ``--weight-loader-disable-mmap`` or checkpoint
   prefetch upstream reads them anyway; they are still not written into the pool);
3. when the stream ends, the reads are joined. If a chunk failed its checksum, the skipped
   expert tensors (still mapped, not read) are fed to the model after all, so the server
   starts from the checkpoint; otherwise the load is logged (GB, GB/s, share read with
   ``O_DIRECT``).

The banks are pinned (CUDA) afterwards, when the first MoE layer's
``process_weights_after_loading`` finalizes the cache, as before: never while empty.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import Iterable, Iterator, Optional, Tuple

import torch

from sglang.srt.layers.moe.expert_cache import pack_format as fmt
from sglang.srt.layers.moe.expert_cache import pack_io

logger = logging.getLogger(__name__)

# A routed expert's checkpoint tensor: "...layers.<layer>.<...>.experts.<expert>.<...>".
ROUTED_EXPERT = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?experts\.(\d+)\.")
READ_THREADS_ENV = "SGLANG_EXPERT_CACHE_PACK_THREADS"


def model_folder(model_path: str, revision: Optional[str] = None) -> Optional[Path]:
    """The local folder of ``model_path`` (a folder, or a hub id already in the local hub
    cache); None when there is none."""
    if os.path.isdir(model_path):
        return Path(model_path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_path, revision=revision, local_files_only=True))
    except Exception:
        return None


def pack_path(folder: Path) -> Optional[Path]:
    """Where the server looks for a pack: ``$SGLANG_EXPERT_CACHE_PACK`` or the model folder's
    ``sglang-expert-pool.pack``; None when packs are off."""
    env = os.environ.get(fmt.PACK_ENV, "")
    if env.lower() == "off":
        return None
    return Path(env) if env else folder / fmt.PACK_FILE


def open_pack(path: Path, folder: Path, cache) -> dict:
    """The checked header of the pack at ``path`` for ``cache``'s pool and model ``folder``.

    Raises:
        PackRefused: the pack does not fit; the message lists every problem and how to repack.
    """
    header = fmt.read_header(path)
    pool = fmt.pool_description(cache.host, cache.num_experts, cache.layer_ids)
    problems = fmt.check_header(header, fmt.model_identity(folder), pool)
    if problems:
        raise fmt.PackRefused(f"{path} does not match this model: " + "; ".join(problems))
    return header


def is_routed_expert(name: str, layers) -> bool:
    """Whether checkpoint tensor ``name`` is a routed expert of one of ``layers``."""
    m = ROUTED_EXPERT.search(name)
    return m is not None and int(m.group(1)) in layers


def with_expert_pack(
    weights: Iterable[Tuple[str, torch.Tensor]],
) -> Iterable[Tuple[str, torch.Tensor]]:
    """``weights`` itself, or, when a valid pack fills the expert cache's host pool, the
    stream without the routed experts while the pack is read (module docstring). Never
    raises for a bad pack: it logs why and returns ``weights``."""
    from sglang.srt.layers.moe.expert_cache.method import get_expert_slot_cache
    from sglang.srt.runtime_context import process_model_config

    cache = get_expert_slot_cache()
    if cache is None or cache.finalized or not cache.layer_ids:
        return weights
    config = process_model_config()
    folder = model_folder(config.model_path, getattr(config, "revision", None))
    path = pack_path(folder) if folder is not None else None
    if path is None:
        return weights
    repack = fmt.REPACK.format(model=config.model_path)
    if not path.exists():
        logger.info(
            "Expert cache: no expert pack at %s; loading the experts from the checkpoint "
            "(`%s` makes one for a faster start)",
            path,
            repack,
        )
        return weights
    try:
        header = open_pack(path, folder, cache)
    except (fmt.PackRefused, OSError, ValueError, KeyError) as e:
        logger.warning(
            "Expert cache: expert pack refused: %s. Loading the experts from the checkpoint "
            "instead; repack with `%s` (or delete %s)",
            e,
            repack,
            path,
        )
        return weights
    return _stream(weights, path, header, cache, repack)


def _stream(weights, path: Path, header: dict, cache, repack: str) -> Iterator:
    threads = int(os.environ.get(READ_THREADS_ENV, pack_io.DEFAULT_THREADS))
    result: dict = {}

    def read() -> None:
        try:
            result["stats"] = pack_io.read_pack(path, cache.host, header["chunks"], threads)
        except BaseException as e:  # reported after the stream, where the fallback is
            result["error"] = e

    reader = threading.Thread(target=read, name="expert-pack-reader", daemon=True)
    logger.info("Expert cache: filling the host pool from the expert pack %s", path)
    reader.start()
    layers = cache.layer_ids
    skipped = []
    try:
        for name, tensor in weights:
            if is_routed_expert(name, layers):
                skipped.append((name, tensor))  # a mapped view: nothing read yet
                continue
            yield name, tensor
    finally:
        reader.join()
    error = result.get("error")
    if error is not None:
        logger.warning(
            "Expert cache: expert pack refused while reading: %s. Loading the experts from "
            "the checkpoint instead; repack with `%s` (or delete %s)",
            error,
            repack,
            path,
        )
        yield from skipped
        return
    s = result["stats"]
    logger.info(
        "Expert cache: loaded the host pool from the expert pack %s: %.2f GB in %.2f s "
        "(%.2f GB/s, %d threads, %.0f%% O_DIRECT); %d expert tensors of the checkpoint skipped",
        path,
        s.nbytes / 1e9,
        s.seconds,
        s.gbps,
        s.threads,
        100.0 * s.direct_bytes / max(s.nbytes, 1),
        len(skipped),
    )
