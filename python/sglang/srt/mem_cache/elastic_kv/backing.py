"""Host (CPU) backing for an elastic KV pool: reserve once, commit and release the tail.

Each KV buffer (one K and one V tensor per layer) becomes a view of its own anonymous private
mapping sized for the largest pool (``max_rows`` rows), reserved with ``MAP_NORESERVE`` so the
reservation costs address space, not memory. The pool's tensors are the leading ``rows`` rows
of these mappings, so their base pointers never move (``data_ptrs`` and anything else that
holds a pointer stay valid) and a resize changes only how many rows are visible:

- release (shrink): ``madvise(MADV_DONTNEED)`` on the whole OS pages past the new last row;
  the kernel drops them at once, so the process's resident memory falls by those bytes, and a
  later touch reads zeros;
- commit (grow): ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14) faults the new rows' pages in
  now, so a grow that cannot get the memory fails here with ``ENOMEM`` (and is rolled back by
  the caller) rather than as an out-of-memory kill at some later step.

This is the CPU counterpart of upstream's CUDA arena (``mem_cache/kv_vmm_backing.py``: reserve a
virtual range, ``commit_range`` the prefix in use); that arena never decommits, this one does.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import List

import numpy as np
import torch

MADV_DONTNEED = 4  # <sys/mman.h>
MADV_POPULATE_WRITE = 23  # Linux 5.14

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.mincore.restype = ctypes.c_int
PAGE = mmap.PAGESIZE


def resident_bytes(addr: int, length: int) -> int:
    """Bytes of the pages in ``[addr, addr + length)`` resident now (``mincore(2)``).

    Args:
        addr: a page-aligned address inside a mapping.
        length: bytes (rounded up to whole pages); 0 or less gives 0.

    Raises:
        OSError: ``mincore`` refused (an address outside a mapping: ``ENOMEM``).
    """
    if length <= 0:
        return 0
    n = -(-length // PAGE)
    vec = (ctypes.c_ubyte * n)()
    if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n * PAGE), vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * PAGE


class CommitFailed(MemoryError):
    """The host could not commit the memory a grow asked for (nothing stays committed)."""


def _madvise(addr: int, length: int, advice: int) -> None:
    """``madvise(2)``; raises OSError with errno on failure."""
    if length <= 0:
        return
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({advice}): {os.strerror(err)}")


class ReservedBuffer:
    """One tensor of shape ``(max_rows, *row_shape)`` over a reserved anonymous mapping.

    Args:
        max_rows: rows reserved (the largest pool the buffer can hold).
        row_shape: the shape of one row (``(head_num, head_dim)`` for a KV buffer).
        dtype: element type.
    """

    def __init__(self, max_rows: int, row_shape, dtype: torch.dtype):
        self.row_shape = tuple(int(d) for d in row_shape)
        self.dtype = dtype
        numel = 1
        for d in self.row_shape:
            numel *= d
        self.row_bytes = numel * torch.empty((), dtype=dtype).element_size()
        self.max_rows = int(max_rows)
        length = max(PAGE, -(-self.max_rows * self.row_bytes // PAGE) * PAGE)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        self._map = mmap.mmap(-1, length, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=self.max_rows * self.row_bytes)
        self.full = raw.view(dtype).view(self.max_rows, *self.row_shape)
        self.base = self.full.data_ptr()

    def rows(self, n: int) -> torch.Tensor:
        """The leading ``n`` rows (a view; same base pointer for every ``n``)."""
        return self.full[:n]

    def _page_span(self, lo_rows: int, hi_rows: int):
        lo = -(-lo_rows * self.row_bytes // PAGE) * PAGE  # first whole page past row lo_rows
        hi = -(-hi_rows * self.row_bytes // PAGE) * PAGE
        return lo, hi

    def release(self, keep_rows: int) -> int:
        """Drop the OS pages that hold only rows at or past ``keep_rows``; returns the bytes
        released (their content reads as zeros afterwards)."""
        lo, hi = self._page_span(keep_rows, self.max_rows)
        _madvise(self.base + lo, hi - lo, MADV_DONTNEED)
        return max(0, hi - lo)

    def commit(self, from_rows: int, to_rows: int) -> None:
        """Fault in the pages of rows ``[from_rows, to_rows)`` now.

        Raises:
            CommitFailed: the kernel refused (``ENOMEM``); the pages it did fault in are
                released again.
        """
        lo = (from_rows * self.row_bytes) // PAGE * PAGE
        _, hi = self._page_span(0, to_rows)
        try:
            _madvise(self.base + lo, hi - lo, MADV_POPULATE_WRITE)
        except OSError as e:
            self.release(from_rows)
            raise CommitFailed(f"could not commit {hi - lo} bytes: {e}") from e

    def resident_bytes(self) -> int:
        """Bytes of this mapping resident now (``mincore(2)``), for tests and the split."""
        return resident_bytes(self.base, len(self._map))


class HostKVBacking:
    """The reserved buffers of one MHA KV pool (K then V per layer, in the pool's order).

    The pool's buffers are moved in, one layer at a time: layer ``l``'s K and V rows are copied
    into their reservations and the entries ``l`` of ``k_buffers`` / ``v_buffers`` (the pool's
    own lists, updated in place) are replaced by views of them, so the old allocation of that
    layer is freed before the next layer is copied (upstream allocates a layer's K and V as the
    two halves of one tensor, ``MHATokenToKVPool._create_buffers_normal``). The move holds the
    pool plus one layer at its peak, not the pool twice. The caller refreshes whatever caches
    the buffers' pointers afterwards, also when this raises (some layers may have moved).

    Args:
        k_buffers, v_buffers: the pool's lists of tensors, ``(rows, head_num, head_dim)`` each
            (contiguous), one per layer; their entries are replaced as described. An MLA pool
            passes its ``kv_buffer`` (one latent row per token) and an empty ``v_buffers``.
        max_rows: rows to reserve per buffer (pool size in tokens + one page of padding, for
            the largest pool a grow may reach).

    Raises:
        ValueError: a buffer that is not contiguous, has more rows than ``max_rows``, or lists
            of different lengths; checked for every buffer before anything moves.
        OSError: a reservation (``mmap``) refused; the layers before it have moved.
    """

    def __init__(self, k_buffers: List[torch.Tensor], v_buffers: List[torch.Tensor], max_rows):
        if v_buffers and len(k_buffers) != len(v_buffers):
            raise ValueError(f"{len(k_buffers)} K buffers but {len(v_buffers)} V buffers")
        for src in list(k_buffers) + list(v_buffers):
            if not src.is_contiguous() or src.shape[0] > max_rows:
                raise ValueError(
                    f"KV buffer of shape {tuple(src.shape)} (contiguous={src.is_contiguous()}) "
                    f"cannot move into a reservation of {max_rows} rows"
                )
        self.k: List[ReservedBuffer] = []
        self.v: List[ReservedBuffer] = []
        self.rows = int(k_buffers[0].shape[0]) if k_buffers else 0
        for layer in range(len(k_buffers)):
            for bufs, out in ((k_buffers, self.k), (v_buffers, self.v))[: 2 if v_buffers else 1]:
                src = bufs[layer]
                buf = ReservedBuffer(max_rows, src.shape[1:], src.dtype)
                view = buf.rows(src.shape[0])
                view.copy_(src)
                out.append(buf)
                bufs[layer] = view  # src is rebound next: the old layer is freed by then

    @property
    def buffers(self) -> List[ReservedBuffer]:
        return self.k + self.v

    @property
    def max_rows(self) -> int:
        return self.k[0].max_rows

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row over all buffers (K and V of every layer)."""
        return sum(b.row_bytes for b in self.buffers)

    def views(self, rows: int):
        """``(k_views, v_views)``: the leading ``rows`` rows of each buffer."""
        return [b.rows(rows) for b in self.k], [b.rows(rows) for b in self.v]

    def release(self, keep_rows: int) -> int:
        """Release every buffer's pages past ``keep_rows``; returns the bytes released."""
        return sum(b.release(keep_rows) for b in self.buffers)

    def commit(self, from_rows: int, to_rows: int) -> None:
        """Commit rows ``[from_rows, to_rows)`` of every buffer, all or none.

        Raises:
            CommitFailed: some buffer could not commit; every buffer is released back to
                ``from_rows``.
        """
        try:
            for b in self.buffers:
                b.commit(from_rows, to_rows)
        except CommitFailed:
            self.release(from_rows)
            raise

    def resident_bytes(self) -> int:
        return sum(b.resident_bytes() for b in self.buffers)
