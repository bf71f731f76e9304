"""The packed expert pool (FreeToken §4.2, "the FTW format"): the host pool's banks on disk.

A pack holds every routed expert of a model in the host pool's own bank layout
(:mod:`banks`: one tensor per bank, leading dimension ``g = layer * E + expert``), so a server
fills its banks with plain reads and no transformation (§3.3 "Fast engine bootstrap"). One file:

====================  =====================================================================
bytes                 content
====================  =====================================================================
``[0, 48)``           prefix: magic ``SGLANG-EXPOOL\\0\\0\\0`` (16), version (u32), reserved
                      (u32), header length (u64), XXH3-128 of the header (16)
``[48, 48 + n)``      the header, UTF-8 JSON (below)
``[data_start, ..)``  the data: per bank, per MoE layer, that layer's ``E`` rows (a *slab*),
                      each slab at an offset aligned to ``ALIGN`` (4096, for ``O_DIRECT``)
====================  =====================================================================

The header records: the pack ``version``; the model ``identity`` (SHA-256 of ``config.json``;
per weight file its name, size, modification time, status-change time (``st_ctime_ns``) and
the SHA-256 of its safetensors header, i.e. tensor names, dtypes, shapes and offsets); the expert ``format`` label, the pool shape
(``num_layers``, ``num_experts``, ``hidden_size``, ``intermediate_size``), the packed MoE
``layers``; per bank its name, row shape and dtype; and the ``slabs``, each cut into chunks of
at most ``chunk_bytes`` with one XXH3-128 checksum per chunk (verified by the reader threads,
right after each chunk lands in the bank). The file's total size is in the header too, so a
truncated file is refused before any read.

Bank-generic: the banks come from ``ExpertBanks.specs`` by name; a format with more banks
(FP8 weights plus scales) packs with no change here.

Reuse of upstream 0.5.23's expert pack (``model_loader/expert_pack/format.py``, ``build.py``,
``validate.py``; ``--load-format expert_pack``): its layout does not fit, and is not reused. It
packs GGUF sources of two models (deepseek_v4, kimi_k3) as one entry per (layer, expert, role)
with the roles gate/up/down fixed in the struct (``ROLE_NAMES``), 80-byte tensor names and
per-entry SHA-256 recomputed by a separate validator pass; our pool is fused ``w13`` rows plus
whatever banks a format adds (scales), read in large aligned slabs, and SHA-256 runs at about
0.2 GB/s per core on this class of CPU, below the disk's direct-I/O bandwidth (XXH3 runs at
several GB/s; ``xxhash`` is already a pinned dependency). What is reused: ``align_up``
(upstream's, imported) and the same atomicity discipline as upstream's ``write_json_atomic``
(temporary file, fsync, rename, fsync of the folder: ``pack_io.write_pack``), and the idea of
a magic, a version and identity digests in the header. Upstream's identity hashes whole
source files; ours hashes ``config.json`` and each safetensors header and compares sizes and
modification and status-change times, since a server start must not read the checkpoint it is
trying to skip (hashing whole weight files at every start reads the whole checkpoint, slower
than the load the pack replaces). The status-change time is what catches a rewrite that keeps
size, header and mtime (``os.utime`` or ``cp -p`` / ``rsync -t`` restore the mtime, but any
write, rename-over or ``utime`` sets ``st_ctime`` to now, and no call sets it back): the file
is whole-file identical to the packed one unless someone also changed the system clock. The
price is false alarms: ``chmod``, ``touch``, or a copy of the model folder (new ctimes) also
refuse the pack, and the message says to repack; the safe direction.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

import xxhash

from sglang.srt.model_loader.expert_pack.format import align_up

MAGIC = b"SGLANG-EXPOOL\0\0\0"
VERSION = 2  # 2: weight files' ctime_ns in the identity
PREFIX = struct.Struct("<16sIIQ16s")  # magic, version, reserved, header length, header XXH3
ALIGN = 4096  # O_DIRECT: file offsets, lengths and buffer addresses in multiples of this
CHUNK_BYTES = 64 << 20  # one reader-thread task and one checksum
PACK_FILE = "sglang-expert-pool.pack"
PACK_ENV = "SGLANG_EXPERT_CACHE_PACK"  # a pack path, or "off"
REPACK = "python -m sglang.srt.layers.moe.expert_cache.pack --model-path {model}"


class PackRefused(ValueError):
    """A pack that must not be loaded: the message lists every problem and how to repack."""


def checksum(buf) -> str:
    """XXH3-128 of a buffer (bytes-like), as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(buf)


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def weight_files(model_dir: Path) -> List[Path]:
    """The checkpoint files the identity covers: every ``*.safetensors`` (then ``*.bin``)."""
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or *.bin weight files in {model_dir}")
    return files


def _safetensors_header_sha256(path: Path) -> str:
    """SHA-256 of a safetensors file's header (8-byte length + JSON): names, dtypes, shapes
    and offsets of every tensor, without reading the tensor data. For other files, of their
    first 1 MiB."""
    with path.open("rb") as f:
        if path.suffix == ".safetensors":
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            return _sha256_bytes(head + f.read(min(n, 1 << 30)))
        return _sha256_bytes(f.read(1 << 20))


def model_identity(model_dir: os.PathLike | str) -> dict:
    """The identity of the model folder a pack was made from (no tensor data is read).

    Returns:
        ``{"config_sha256": hex, "weight_files": [{"name", "size", "mtime_ns", "ctime_ns",
        "header_sha256"}, ...]}``.

    Raises:
        FileNotFoundError: no ``config.json`` or no weight files in ``model_dir``.
    """
    d = Path(model_dir)
    files = []
    for p in weight_files(d):
        st = p.stat()
        files.append(
            dict(
                name=p.name,
                size=st.st_size,
                mtime_ns=st.st_mtime_ns,
                ctime_ns=st.st_ctime_ns,
                header_sha256=_safetensors_header_sha256(p),
            )
        )
    return dict(config_sha256=_sha256_bytes((d / "config.json").read_bytes()), weight_files=files)


@dataclass(frozen=True)
class Chunk:
    """One read task: ``nbytes`` at file ``offset`` into bank ``bank`` at byte ``dst`` (from
    the bank tensor's start), with its checksum."""

    bank: str
    offset: int
    dst: int
    nbytes: int
    checksum: str


def pool_description(banks, num_experts: int, layers: Sequence[int]) -> dict:
    """What a pack of ``banks`` (an ``ExpertBanks``) holds: the header's pool fields."""
    return dict(
        format=banks.format.label,
        rows=banks.rows,
        num_experts=num_experts,
        hidden_size=banks.hidden_size,
        intermediate_size=banks.intermediate_size,
        layers=sorted(int(x) for x in layers),
        banks=[
            dict(name=s.name, row_shape=list(s.row_shape), dtype=str(s.dtype).split(".")[-1])
            for s in banks.specs
        ],
    )


def plan_chunks(banks, num_experts: int, layers: Sequence[int], data_start: int) -> List[Chunk]:
    """The file layout of a pack of ``banks``: for every bank (spec order) and MoE layer
    (ascending), that layer's ``num_experts`` rows as one slab starting at an ``ALIGN``ed file
    offset, cut into chunks of ``CHUNK_BYTES`` (a multiple of ``ALIGN``). Checksums empty."""
    chunks = []
    offset = data_start
    for spec in banks.specs:
        t = banks[spec.name]
        row_bytes = t[0].numel() * t.element_size()
        for layer in sorted(layers):
            dst = layer * num_experts * row_bytes
            slab = num_experts * row_bytes
            for start in range(0, slab, CHUNK_BYTES):
                n = min(CHUNK_BYTES, slab - start)
                chunks.append(Chunk(spec.name, offset + start, dst + start, n, ""))
            offset = align_up(offset + slab, ALIGN)
    return chunks


def encode_header(header: dict) -> bytes:
    """The prefix and header bytes of a pack (``data_start`` is what follows, aligned)."""
    body = json.dumps(header, sort_keys=True).encode()
    return PREFIX.pack(MAGIC, VERSION, 0, len(body), bytes.fromhex(checksum(body))) + body


def header_span(header_json_bytes: int) -> int:
    """``data_start`` for a header of this many bytes."""
    return align_up(PREFIX.size + header_json_bytes, ALIGN)


def read_header(path: os.PathLike | str) -> dict:
    """The header of the pack at ``path``, with its chunks as :class:`Chunk` under ``chunks``.

    Raises:
        PackRefused: not a pack, another version, a corrupt header, or a file of another size
            than the header says (truncated or appended to).
    """
    p = Path(path)
    size = p.stat().st_size
    with p.open("rb") as f:
        raw = f.read(PREFIX.size)
        if len(raw) < PREFIX.size:
            raise PackRefused(f"{p} is truncated ({size} bytes: not even the pack prefix)")
        magic, version, _, n, digest = PREFIX.unpack(raw)
        if magic != MAGIC:
            raise PackRefused(f"{p} is not an expert-pool pack (magic {magic!r})")
        if version != VERSION:
            raise PackRefused(f"{p} is pack version {version}; this server reads version {VERSION}")
        body = f.read(n)
    if len(body) != n or checksum(body) != digest.hex():
        raise PackRefused(f"{p}: the header is truncated or corrupt (checksum mismatch)")
    header = json.loads(body)
    if header.get("file_bytes") != size:
        raise PackRefused(
            f"{p} is {size} bytes, its header says {header.get('file_bytes')} (truncated or "
            "partially written)"
        )
    header["chunks"] = [Chunk(**c) for c in header["chunks"]]
    return header


def check_header(header: dict, identity: dict, pool: dict) -> List[str]:
    """Every mismatch between a pack's header and the model and pool it would fill."""
    problems = []
    have = header.get("identity", {})
    if have.get("config_sha256") != identity["config_sha256"]:
        problems.append("config.json changed since the pack was made")
    old = {f["name"]: f for f in have.get("weight_files", [])}
    new = {f["name"]: f for f in identity["weight_files"]}
    if set(old) != set(new):
        problems.append(f"weight files differ (pack: {sorted(old)}, model folder: {sorted(new)})")
    for name in sorted(set(old) & set(new)):
        keys = ("size", "mtime_ns", "ctime_ns", "header_sha256")
        changed = [k for k in keys if old[name].get(k) != new[name][k]]
        if changed:
            problems.append(f"{name} changed since the pack was made ({', '.join(changed)})")
    for key, want in pool.items():
        if header.get("pool", {}).get(key) != want:
            problems.append(
                f"pool {key} is {header.get('pool', {}).get(key)!r} in the pack, the server "
                f"needs {want!r}"
            )
    return problems


def chunk_table(chunks: Sequence[Chunk]) -> List[Dict]:
    return [c.__dict__ for c in chunks]
