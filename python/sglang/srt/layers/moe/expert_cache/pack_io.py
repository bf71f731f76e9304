"""Writing and reading a packed expert pool (layout: :mod:`pack_format`).

* :func:`write_pack`: the banks' MoE-layer slabs to a temporary file beside the target,
  chunk checksums computed as they are written, the header last, ``fsync``, ``rename`` onto
  the target, ``fsync`` of the folder (upstream's ``write_json_atomic`` discipline). A killed
  writer leaves only ``.NAME.tmp.PID``, which no reader opens; the next pack removes it.
* :func:`read_pack`: parallel reads straight into the exact-size bank tensors (no staging
  buffer), ``O_DIRECT`` where the file system allows it (the page cache is bypassed, so the
  pool is not held twice in RAM), buffered ``preadv`` for what direct I/O cannot take (an
  unaligned bank address or a tail that is not a multiple of 4096 bytes) and for everything
  when the file system refuses ``O_DIRECT`` (tmpfs). Each reader thread verifies the checksum
  of every chunk it read (XXH3 releases the GIL, as ``preadv`` does), so verification runs in
  parallel with the reads of the other threads. Before its read, each thread commits the
  chunk's bank pages (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+; ignored where refused).
  With ``pin``, each bank is handed to a background pinning thread as soon as its last chunk
  is verified, while the other banks are still being read (FreeToken §3.3: pin only filled
  memory; here overlapped with the reads of the rest).

Where the time goes (``benchmark/expert_cache/bench_pool_load.py``, RESULTS.md): not the
Python threads, the GIL or the checksum (XXH3 of the whole pool is ~0.2 s of CPU; each chunk is
one ``preadv`` of up to 64 MiB and one hash call, both outside the GIL) but the first touch of
the fresh bank pages: ``O_DIRECT`` into untouched anonymous memory faults and zeroes every page
inside the read syscall, 4 KiB at a time (about 1 s of CPU per GB on the benchmark machine),
serialized behind the read it blocks. Committing the pages in batches with
``MADV_POPULATE_WRITE`` first, per chunk and in the reader threads, overlaps it with the other
threads' reads. So the readers stay in Python (no C++ reader).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from sglang.srt.layers.moe.expert_cache import pack_format as fmt

logger = logging.getLogger(__name__)

DEFAULT_THREADS = 4
_MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+)
_libc = None


def _populate(addr: int, nbytes: int) -> bool:
    """Commit the whole pages inside ``[addr, addr + nbytes)`` for writing, in one call
    (``madvise(MADV_POPULATE_WRITE)``, which releases the GIL through ctypes). Returns False
    where the kernel refuses it (older than 5.14, or not anonymous memory): the read then
    faults the pages in itself."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lo = -(-addr // fmt.ALIGN) * fmt.ALIGN
    hi = (addr + nbytes) // fmt.ALIGN * fmt.ALIGN
    return hi <= lo or _libc.madvise(lo, hi - lo, _MADV_POPULATE_WRITE) == 0


def _view(tensor, dst: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of ``tensor``'s memory from byte ``dst`` (bounds
    checked against the tensor's size)."""
    total = tensor.numel() * tensor.element_size()
    if dst < 0 or dst + nbytes > total:
        raise ValueError(f"chunk [{dst}, {dst + nbytes}) outside a bank of {total} bytes")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr() + dst)).cast("B")


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000)


def write_pack(
    path: os.PathLike | str,
    banks,
    num_experts: int,
    layers: Sequence[int],
    identity: dict,
    progress: bool = True,
) -> dict:
    """Write the MoE-layer rows of ``banks`` (an ``ExpertBanks``) as a pack at ``path``.

    Args:
        path: the pack file; its folder must exist.
        banks: the filled host pool (rows ``layer * num_experts + e``).
        num_experts: routed experts per MoE layer (E).
        layers: the MoE layers whose rows are packed (dense layers' rows are not).
        identity: :func:`pack_format.model_identity` of the model folder.
        progress: show a bar (GB, GB/s) on stderr.

    Returns:
        the header written (chunks as dicts, with checksums).

    Raises:
        OSError: the file cannot be written (nothing is left at ``path`` then).
    """
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.tmp.*"):
        stale.unlink(missing_ok=True)  # left by a killed packer
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    pool = fmt.pool_description(banks, num_experts, layers)
    header = dict(version=fmt.VERSION, identity=identity, pool=pool, chunk_bytes=fmt.CHUNK_BYTES)

    # The header's length depends on the offsets it lists; every checksum is 32 hex digits.
    data_start = fmt.ALIGN
    while True:
        chunks = fmt.plan_chunks(banks, num_experts, layers, data_start)
        file_bytes = max((c.offset + c.nbytes for c in chunks), default=data_start)
        trial = dict(header, file_bytes=file_bytes, data_start=data_start)
        trial["chunks"] = fmt.chunk_table([replace(c, checksum="0" * 32) for c in chunks])
        need = fmt.header_span(len(fmt.encode_header(trial)) - fmt.PREFIX.size)
        if need == data_start:
            break
        data_start = need

    total = sum(c.nbytes for c in chunks)
    bar = _progress(total, "Packing experts") if progress else None
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, file_bytes)
        done = []
        for c in chunks:
            mv = _view(banks[c.bank], c.dst, c.nbytes)
            written = 0
            while written < c.nbytes:
                written += os.pwrite(fd, mv[written:], c.offset + written)
            done.append(replace(c, checksum=fmt.checksum(mv)))
            if bar is not None:
                bar.update(c.nbytes)
        final = dict(header, file_bytes=file_bytes, data_start=data_start)
        final["chunks"] = fmt.chunk_table(done)
        raw = fmt.encode_header(final)
        assert fmt.header_span(len(raw) - fmt.PREFIX.size) == data_start
        os.pwrite(fd, raw, 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


@dataclass
class ReadStats:
    """What :func:`read_pack` did: bytes, seconds, bytes read with ``O_DIRECT``, threads, and
    the banks pinned in the background (in the order they were pinned)."""

    nbytes: int
    seconds: float
    direct_bytes: int
    threads: int
    pinned: List[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


def _read_into(fd: int, mv: memoryview, offset: int) -> None:
    got = 0
    while got < len(mv):
        n = os.preadv(fd, [mv[got:]], offset + got)
        if n == 0:
            raise fmt.PackRefused(f"short read at byte {offset + got}: the pack is truncated")
        got += n


def _open_direct(path: Path) -> Optional[int]:
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None


def read_pack(
    path: os.PathLike | str,
    banks,
    chunks: Sequence["fmt.Chunk"],
    threads: int = DEFAULT_THREADS,
    direct: bool = True,
    progress: bool = True,
    verify: bool = True,
    pin: Optional[Callable[[str], bool]] = None,
) -> ReadStats:
    """Read ``chunks`` of the pack at ``path`` into ``banks``' tensors and verify them.

    Args:
        path: the pack (header already checked: :func:`pack_format.read_header`).
        banks: an ``ExpertBanks`` (or any mapping bank name -> CPU tensor) of the pool shape.
        chunks: the header's chunks.
        threads: reader threads (each commits the chunk's pages, reads it and verifies it).
        direct: try ``O_DIRECT`` (falls back to buffered reads where it is refused).
        progress: show a bar (GB, GB/s) on stderr.
        verify: check every chunk's XXH3-128 (off only to measure what checksums cost).
        pin: called as ``pin(bank_name)`` on one background thread as soon as the last chunk
            of that bank is read and verified (while other banks are still being read), once
            per bank, in the order banks complete; returns True when pinned (the names are
            in ``ReadStats.pinned``). Never called after a failed chunk. ``read_pack`` returns
            only when every pin call has returned.

    Returns:
        :class:`ReadStats`.

    Raises:
        PackRefused: a chunk fails its checksum or the file ends early; the banks then hold
            partial data and must be refilled (the caller loads the checkpoint instead).
    """
    path = Path(path)
    buffered = os.open(path, os.O_RDONLY)
    dfd = _open_direct(path) if direct else None
    lock = threading.Lock()
    state = dict(direct_ok=dfd is not None, direct_bytes=0, populate=True, failed=False)
    total = sum(c.nbytes for c in chunks)
    bar = _progress(total, "Loading expert pack") if progress else None
    left = {}  # bank -> chunks not yet verified
    for c in chunks:
        left[c.bank] = left.get(c.bank, 0) + 1
    pinned: List[str] = []
    pinner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pack-pin") if pin else None
    pin_futures = []

    def pin_one(name: str) -> None:
        if pin(name):
            pinned.append(name)

    def one(c: "fmt.Chunk") -> None:
        bank = banks[c.bank]
        mv = _view(bank, c.dst, c.nbytes)
        head = 0
        addr = bank.data_ptr() + c.dst
        if state["populate"] and not _populate(addr, c.nbytes):
            state["populate"] = False  # refused (old kernel): the reads fault the pages in
        if state["direct_ok"] and addr % fmt.ALIGN == 0 and c.offset % fmt.ALIGN == 0:
            head = c.nbytes // fmt.ALIGN * fmt.ALIGN
            try:
                if head:
                    _read_into(dfd, mv[:head], c.offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                state["direct_ok"] = False  # refused at read time (some FUSE / overlay fs)
                head = 0
        if head < c.nbytes:
            _read_into(buffered, mv[head:], c.offset + head)
        if verify and fmt.checksum(mv) != c.checksum:
            raise fmt.PackRefused(
                f"{path}: the chunk at byte {c.offset} ({c.nbytes} bytes of bank {c.bank}) "
                "fails its checksum (the file is corrupt)"
            )
        with lock:
            state["direct_bytes"] += head
            left[c.bank] -= 1
            if pinner is not None and left[c.bank] == 0 and not state["failed"]:
                pin_futures.append(pinner.submit(pin_one, c.bank))
            if bar is not None:
                bar.update(c.nbytes)

    def guarded(c: "fmt.Chunk") -> None:
        try:
            one(c)
        except BaseException:
            with lock:
                state["failed"] = True
            raise

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            futures = [pool.submit(guarded, c) for c in chunks]
            errors: List[BaseException] = []
            for f in futures:
                try:
                    f.result()
                except BaseException as e:  # collect, so every thread has stopped on return
                    errors.append(e)
            if errors:
                raise errors[0]
    finally:
        if pinner is not None:
            pinner.shutdown(wait=True)
        if bar is not None:
            bar.close()
        os.close(buffered)
        if dfd is not None:
            os.close(dfd)
    for f in pin_futures:
        f.result()
    return ReadStats(total, time.perf_counter() - start, state["direct_bytes"], threads, pinned)
