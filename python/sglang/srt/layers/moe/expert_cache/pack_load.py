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
   ``layers.<l>. ... .experts.<e>.``, or ``layers.<l>. ... .experts.gate_up_proj...`` /
   ``down_proj...`` where a checkpoint fuses a layer's experts in one tensor:
   :data:`ROUTED_EXPERT`). Upstream's safetensors iterators map the files, so a skipped
   tensor's bytes are never read (with ``--weight-loader-disable-mmap`` or checkpoint
   prefetch upstream reads them anyway; they are still not written into the pool);
3. when the stream ends, the reads are joined. If a chunk failed its checksum, the skipped
   expert tensors (still mapped, not read) are fed to the model after all, so the server
   starts from the checkpoint; otherwise the load is logged (GB, GB/s, share read with
   ``O_DIRECT``).

Without a usable pack (none, packs off, or refused) the stream goes through
:func:`with_progress`: a bar of the experts written into the host pool (GB, GB/s) and one log
line at the end.

On CUDA each host bank is pinned (``ExpertBanks.pin_bank``) on a background thread as soon as
the pack has filled it, while the other banks are still read (``read_pack``'s ``pin``); the
cache's ``finalize`` then finds them pinned. Without a pack the banks are pinned at
``finalize``, after the checkpoint load: never while empty.
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

# A routed expert's checkpoint tensor: one expert's ("...layers.<layer>.<...>.experts.<expert>.
# <...>": Qwen3-MoE, DeepSeek, Mixtral) or all of a layer's experts fused in one tensor
# ("...layers.<layer>.<...>.experts.gate_up_proj[_blocks|_scales|_bias]", "...experts.down_proj":
# gpt-oss, Gemma 4, Llama 4 as transformers saves them). A shared expert ("shared_expert.",
# "shared_experts.") is neither.
ROUTED_EXPERT = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?experts\."
    r"(?:\d+\.|(?:gate_up|gate|up|down)_proj(?:_(?:blocks|scales|bias))?(?:\.|$))"
)
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
    """Whether checkpoint tensor ``name`` is a routed expert of one of ``layers``, held by the
    host pool. An expert's ``input_scale`` (static FP8 activations: compressed-tensors'
    per-tensor scheme, ModelOpt) is not: it loads into a layer parameter beside the banks,
    so it stays in the stream."""
    if name.endswith(".input_scale"):
        return False
    m = ROUTED_EXPERT.search(name)
    return m is not None and int(m.group(1)) in layers


def with_expert_pack(
    weights: Iterable[Tuple[str, torch.Tensor]],
) -> Iterable[Tuple[str, torch.Tensor]]:
    """``weights`` itself (without an expert cache), ``weights`` with a progress bar of the
    experts written into the host pool (:func:`with_progress`: no pack, packs off, or a pack
    refused), or, when a valid pack fills the host pool, the stream without the routed
    experts while the pack is read (module docstring). Never raises for a bad pack: it logs
    why and loads the checkpoint."""
    from sglang.srt.layers.moe.expert_cache.method import get_expert_slot_cache
    from sglang.srt.runtime_context import process_model_config

    cache = get_expert_slot_cache()
    if cache is None or cache.finalized or not cache.layer_ids:
        return weights
    config = process_model_config()
    folder = model_folder(config.model_path, getattr(config, "revision", None))
    path = pack_path(folder) if folder is not None else None
    if path is None:
        return with_progress(weights, cache.layer_ids, cache.host.expert_bytes * cache.pool_experts)
    repack = fmt.REPACK.format(model=config.model_path)
    if not path.exists():
        logger.info(
            "Expert cache: no expert pack at %s; loading the experts from the checkpoint "
            "(`%s` makes one for a faster start)",
            path,
            repack,
        )
        return with_progress(weights, cache.layer_ids, cache.host.expert_bytes * cache.pool_experts)
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
        return with_progress(weights, cache.layer_ids, cache.host.expert_bytes * cache.pool_experts)
    return _stream(weights, path, header, cache, repack)


def with_progress(
    weights: Iterable[Tuple[str, torch.Tensor]], layers, pool_bytes: int, progress: bool = True
) -> Iterator[Tuple[str, torch.Tensor]]:
    """``weights`` unchanged, with a progress bar (GB, GB/s, on stderr) of the routed expert
    tensors of ``layers`` going by (the ones ``FusedMoE``'s loaders write into the host pool)
    and one log line when the stream ends: GB, seconds, GB/s.

    Args:
        weights: the checkpoint's ``(name, tensor)`` stream.
        layers: the expert cache's MoE layers.
        pool_bytes: the bar's total (the host pool's routed bytes; a checkpoint's experts in
            another dtype make the bar end below or above it, the log line has the real count).
        progress: show the bar (the log line is always written).
    """
    import time

    from tqdm import tqdm

    bar = tqdm(
        total=pool_bytes,
        desc="Experts into the host pool",
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        mininterval=1.0,
        disable=not progress,
    )
    nbytes, count, t0 = 0, 0, time.perf_counter()
    try:
        for name, tensor in weights:
            if is_routed_expert(name, layers):
                n = tensor.numel() * tensor.element_size()
                nbytes += n
                count += 1
                bar.update(n)
            yield name, tensor
    finally:
        bar.close()
    dt = time.perf_counter() - t0
    logger.info(
        "Expert cache: wrote the host pool from the checkpoint: %d routed expert tensors, "
        "%.2f GB in %.2f s (%.2f GB/s, the whole weight stream's time)",
        count,
        nbytes / 1e9,
        dt,
        nbytes / max(dt, 1e-9) / 1e9,
    )


def _stream(weights, path: Path, header: dict, cache, repack: str) -> Iterator:
    threads = int(os.environ.get(READ_THREADS_ENV, pack_io.DEFAULT_THREADS))
    pin = cache.host.pin_bank if cache.device.type == "cuda" else None
    result: dict = {}

    def read() -> None:
        try:
            result["stats"] = pack_io.read_pack(
                path, cache.host, header["chunks"], threads, pin=pin
            )
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
        "(%.2f GB/s, %d threads, %.0f%% O_DIRECT, %d banks pinned while reading); %d expert "
        "tensors of the checkpoint skipped",
        path,
        s.nbytes / 1e9,
        s.seconds,
        s.gbps,
        s.threads,
        100.0 * s.direct_bytes / max(s.nbytes, 1),
        len(s.pinned),
        len(skipped),
    )
