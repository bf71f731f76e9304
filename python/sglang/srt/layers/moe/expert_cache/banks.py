"""Expert banks: the routed-expert tensors of every MoE layer in one runtime layout.

A bank is one tensor whose leading dimension is the flattened expert id
``g = layer * num_experts + expert`` (FreeToken §4.2, "Expert banks"); the rows with one id
across all banks form one complete expert. The host pool (all experts, the source of truth)
and the device slots (the cache) use the same bank layout, so one (source id, destination
slot) work list copies an expert across every bank, and the CPU executor and the device
kernels index experts the same way.

A format's banks are the per-expert tensors of the layer's quant method, found on the layer
after the method's ``create_weights`` as upstream's paged experts finds them
(``paged_experts.formats.expert_params``: every ``w13_*`` / ``w2_*`` parameter with one row per
expert): BF16 has ``w13`` and ``w2``; block FP8 (``Fp8MoEMethod``) adds ``w13_scale`` /
``w2_scale`` (``w13_weight_scale_inv`` / ``w2_weight_scale_inv``, float32, one scale per
128 x 128 block). The cache, the control step and the copy work list only see rows and never
change with the format.
``formats.py`` holds the float64 dequantize references of the quantized formats (FP8, MXFP4,
NVFP4) and their executor format codes.
"""

from __future__ import annotations

import logging
import math
import mmap
import weakref
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BankSpec:
    """One bank: ``layer_param`` is the ``FusedMoE`` parameter whose rows it holds."""

    name: str
    layer_param: str
    row_shape: Tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ExpertFormat:
    """How one complete expert is stored: its banks, for a given expert shape.

    ``dtype`` is the dtype of the ``w13`` / ``w2`` weight banks; ``specs`` the banks found on a
    layer (:func:`format_from_layer`), empty for BF16, whose two banks follow from the shape;
    ``weight_block_size`` the (rows, cols) block of one scale of a block-quantized format.
    """

    label: str
    dtype: torch.dtype
    specs: Tuple[BankSpec, ...] = ()
    weight_block_size: Optional[Tuple[int, int]] = None

    @property
    def quantized(self) -> bool:
        """True when the weights carry scale banks (the activations stay bf16)."""
        return self.weight_block_size is not None

    @property
    def act_dtype(self) -> torch.dtype:
        """The dtype of the activations the experts take and return."""
        return torch.bfloat16 if self.quantized else self.dtype

    def scale_banks(self) -> Tuple[str, ...]:
        """Names of the scale banks (``w13_scale``, ``w2_scale``), empty when unquantized."""
        return tuple(s.name for s in self.specs if s.name.endswith("_scale"))

    def banks(self, hidden_size: int, intermediate_size: int) -> Tuple[BankSpec, ...]:
        """The banks of an expert with ``hidden_size`` H and ``intermediate_size`` I:
        ``w13`` [2I, H] (gate rows then up rows, SGLang's ``w13_weight``) and ``w2`` [H, I],
        then a quantized format's scale banks.

        Raises:
            ValueError: the format was found on a layer of another expert shape.
        """
        h, i = hidden_size, intermediate_size
        if not self.specs:
            return (
                BankSpec("w13", "w13_weight", (2 * i, h), self.dtype),
                BankSpec("w2", "w2_weight", (h, i), self.dtype),
            )
        by_name = {s.name: s for s in self.specs}
        if by_name["w13"].row_shape != (2 * i, h) or by_name["w2"].row_shape != (h, i):
            raise ValueError(
                f"{self.label} banks are of experts {by_name['w2'].row_shape[::-1]} (I, H), "
                f"not ({i}, {h})"
            )
        return self.specs

    @property
    def executor_format(self) -> str:
        """The CPU executor's ``format`` name for these banks (``sgl_kernel_fork.cpu_executor``)."""
        return "bf16"


BF16 = ExpertFormat(label="bf16", dtype=torch.bfloat16)
FORMATS = {BF16.dtype: BF16}
# The per-expert parameters of FusedMoE quant methods that the banks hold, by bank name.
_BANK_NAMES = {
    "w13_weight": "w13",
    "w2_weight": "w2",
    "w13_weight_scale_inv": "w13_scale",
    "w2_weight_scale_inv": "w2_scale",
}


def format_from_layer(
    layer: torch.nn.Module,
    num_experts: int,
    label: str,
    weight_block_size: Optional[Tuple[int, int]] = None,
) -> ExpertFormat:
    """The format of the per-expert tensors a quant method's ``create_weights`` put on
    ``layer``, found as upstream's paged experts finds them
    (``paged_experts.formats.expert_params``). Shapes and dtypes are read from the parameters
    (they may live on the meta device).

    Args:
        layer: a ``FusedMoE`` layer after its base method's ``create_weights``.
        num_experts: experts of the layer (E): a per-expert tensor has E rows.
        label: the format's name in logs and errors (e.g. ``fp8-block``).
        weight_block_size: (block_n, block_k) of one scale, None when unquantized.

    Raises:
        ValueError: the layer has a per-expert tensor the banks do not know (biases, zero
            points, other scales), or lacks ``w13_weight`` / ``w2_weight``.
    """
    from sglang.srt.layers.moe.paged_experts.formats import expert_params

    names = expert_params(layer, num_experts)
    unknown = [n for n in names if n not in _BANK_NAMES]
    if unknown or "w13_weight" not in names or "w2_weight" not in names:
        raise ValueError(
            f"--enable-expert-cache: the {label} method creates per-expert tensors "
            f"{list(names)}; the host pool holds {sorted(_BANK_NAMES)} (unsupported: {unknown})"
        )
    order = sorted(names, key=list(_BANK_NAMES).index)
    specs = tuple(
        BankSpec(
            _BANK_NAMES[n],
            n,
            tuple(getattr(layer, n).shape[1:]),
            getattr(layer, n).dtype,
        )
        for n in order
    )
    block = tuple(weight_block_size) if weight_block_size is not None else None
    return ExpertFormat(label=label, dtype=specs[0].dtype, specs=specs, weight_block_size=block)


def _storage_span(t: torch.Tensor) -> Tuple[int, int]:
    """(address, bytes) of the whole storage under ``t``: what ``cudaHostRegister`` must cover
    for ``t.is_pinned()`` to hold, since torch asks the driver about the storage's base address,
    not the view's (a bank registered from a view's address reads as not pinned)."""
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _row_bytes(spec: BankSpec) -> int:
    """Bytes of one row (one expert) of a bank."""
    return math.prod(spec.row_shape) * torch.empty((), dtype=spec.dtype).element_size()


def format_for_dtype(dtype: torch.dtype) -> ExpertFormat:
    """The expert format of unquantized experts of ``dtype``.

    Raises:
        ValueError: no format handles ``dtype``; the message says what is supported.
    """
    fmt = FORMATS.get(dtype)
    if fmt is None:
        raise ValueError(
            f"--enable-expert-cache supports {', '.join(f.label for f in FORMATS.values())} "
            f"experts; this model's experts are {dtype} (serve it with --dtype bfloat16)"
        )
    return fmt


# Host banks start at a page boundary: a packed pool is read into them with O_DIRECT, which
# needs buffer addresses aligned like the file offsets (pack_format.ALIGN).
HOST_ALIGN = 4096


def _empty(
    shape, dtype: torch.dtype, device: torch.device
) -> Tuple[torch.Tensor, Optional[mmap.mmap]]:
    """An uninitialized tensor, and on the CPU the mapping under it: its storage is an anonymous
    private mapping of its own, so it starts at a page boundary (a multiple of ``HOST_ALIGN``),
    its pages are committed only when written, and no other allocation shares its first or last
    page (``cudaHostRegister`` of the whole storage, :meth:`ExpertBanks.pin_bank`, never overlaps
    another registration). The mapping lives while the tensor or any view of it does (torch's
    frombuffer holds it); None on other devices or for zero bytes."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=device), None
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(dtype).view(shape), mm


def _unregister_host(ptr: int) -> None:
    """``cudaHostUnregister(ptr)``, for a pinned bank's mapping that is being freed."""
    torch.cuda.cudart().cudaHostUnregister(ptr)


class ExpertBanks:
    """``rows`` experts in every bank of ``fmt``, on ``device``.

    Host banks are allocated uninitialized, each at a page boundary (``O_DIRECT`` reads of a
    packed pool land in them, :mod:`pack_io`): pages are touched only when a row is written,
    so rows of dense layers (never loaded) cost no memory. Pinning, when a GPU copies from them,
    happens after the rows are filled (:meth:`pin`), as FreeToken §3.3 prescribes: pinning
    empty buffers would fault in and zero every page first.

    ``reserve=True`` (the slot banks of a resizable cache) on the CPU maps each bank as
    anonymous memory with ``MAP_NORESERVE``: address space for all ``rows`` is reserved, a
    page is committed when first written, and :meth:`release_rows` hands the pages of a tail
    back to the OS (``madvise(MADV_DONTNEED)``) while the base pointers stay put. On CUDA the
    banks are ordinary allocations of ``rows`` (a VMM reservation is the GPU design's next
    step; ``release_rows`` then returns nothing).
    """

    def __init__(
        self,
        fmt: ExpertFormat,
        hidden_size: int,
        intermediate_size: int,
        rows: int,
        device: torch.device | str,
        reserve: bool = False,
    ):
        self.format = fmt
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.specs = fmt.banks(hidden_size, intermediate_size)
        self.rows = rows
        self.device = torch.device(device)
        self._maps: Dict[str, mmap.mmap] = {}  # reserved banks' mappings (release_rows)
        self._host_maps: Dict[str, mmap.mmap] = {}  # host banks' mappings (_empty)
        self.tensors: Dict[str, torch.Tensor] = {}
        for s in self.specs:
            if reserve and self.device.type == "cpu":
                self.tensors[s.name] = self._reserved(s, rows)
            else:
                t, mm = _empty((rows, *s.row_shape), s.dtype, self.device)
                self.tensors[s.name] = t
                if mm is not None:
                    self._host_maps[s.name] = mm
        self._registered = False  # every bank pinned (pin())
        self._pinned_banks: set = set()  # banks pinned so far (pin_bank())
        # bank -> the finalizer that unregisters it when its mapping is freed (pin_bank())
        self._unpin_at_free: Dict[str, weakref.finalize] = {}

    def _reserved(self, spec: BankSpec, rows: int) -> torch.Tensor:
        nbytes = rows * _row_bytes(spec)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        mm = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=flags)
        self._maps[spec.name] = mm
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        return flat.view(spec.dtype).view(rows, *spec.row_shape)

    def _tail_span(self, spec: BankSpec, start: int, stop: int) -> Tuple[int, int]:
        """Byte offsets ``[lo, hi)`` of the whole pages of rows ``[start, stop)`` that hold no
        row below ``start`` (the pages a release of the tail from ``start`` drops)."""
        rb, pg = _row_bytes(spec), mmap.PAGESIZE
        lo = -(-start * rb // pg) * pg
        hi = min(-(-stop * rb // pg) * pg, len(self._maps[spec.name]))
        return lo, max(lo, hi)

    def resident_bytes(self, start: int = 0, stop: Optional[int] = None) -> int:
        """Bytes of the reserved banks' memory resident now (``mincore(2)``) in the pages of
        rows ``[start, stop)`` that a :meth:`release_rows` from ``start`` would drop: what a
        shrink to ``start`` rows returns to the OS, where a row never written since the last
        release holds nothing (0 for banks that are not reserved).

        Raises:
            ValueError: ``0 <= start <= stop <= rows`` does not hold.
        """
        from sglang.srt.mem_cache.elastic_kv.backing import resident_bytes

        stop = self.rows if stop is None else stop
        if not 0 <= start <= stop <= self.rows:
            raise ValueError(f"resident_bytes({start}, {stop}) outside [0, {self.rows}]")
        total = 0
        for spec in self.specs:
            if spec.name not in self._maps:
                continue
            lo, hi = self._tail_span(spec, start, stop)
            base = self.tensors[spec.name].data_ptr()
            total += resident_bytes(base + lo, hi - lo)
        return total

    def release_rows(self, start: int) -> int:
        """Return the memory of rows ``[start, rows)`` of every reserved bank to the OS; the
        rows read as zeros afterwards and are committed again when written.

        Returns:
            bytes returned to the OS: the resident pages of the tail that holds no row below
            ``start`` (:meth:`resident_bytes` just before; 0 for banks that are not reserved).

        Raises:
            ValueError: ``start`` outside ``[0, rows]``.
        """
        if not 0 <= start <= self.rows:
            raise ValueError(f"release_rows({start}) outside [0, {self.rows}]")
        released = self.resident_bytes(start)
        for spec in self.specs:
            mm = self._maps.get(spec.name)
            if mm is None:
                continue
            lo, _ = self._tail_span(spec, start, self.rows)
            if lo < len(mm):
                mm.madvise(mmap.MADV_DONTNEED, lo, len(mm) - lo)
        return released

    @property
    def expert_bytes(self) -> int:
        """Bytes of one complete expert across all banks."""
        return sum(_row_bytes(s) for s in self.specs)

    def bank_list(self):
        """The bank tensors in spec order (the order every op receives them in)."""
        return [self.tensors[s.name] for s in self.specs]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def pin(self) -> bool:
        """Page-lock the host banks in place so copies to a GPU run at full bandwidth (banks
        already pinned by :meth:`pin_bank`, e.g. while a pack was read, are kept).

        Returns:
            True when pinned (also when already pinned, e.g. a pool shared by several caches);
            False when there is no CUDA or the driver refused (the caller falls back to running
            every expert on the CPU, paper §4.2 "Platform adaptation").
        """
        if self.device.type != "cpu" or not torch.cuda.is_available():
            return False
        if self._registered:
            return True
        for name in self.tensors:
            if not self.pin_bank(name):
                self.unpin()
                return False
        self._registered = True
        return True

    def pin_bank(self, name: str) -> bool:
        """Page-lock one host bank (``cudaHostRegister`` of its whole storage), e.g. as soon as
        a pack has filled it (:func:`pack_io.read_pack`'s ``pin``). Thread-safe against
        itself only; call before :meth:`pin`.

        Returns:
            True when that bank is pinned; False without CUDA or when the driver refused
            (logged; :meth:`pin` then tries again and reports the fallback).

        Raises:
            KeyError: no bank of that name.
        """
        t = self.tensors[name]
        if name in self._pinned_banks:
            return True
        if self.device.type != "cpu" or not torch.cuda.is_available():
            return False
        ptr, nbytes = _storage_span(t)
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            logger.warning(
                "Expert cache: could not pin the %s host bank (%.2f GB, cudaError %s)",
                name,
                t.numel() * t.element_size() / 1e9,
                int(err),
            )
            return False
        self._pinned_banks.add(name)
        mm = self._host_maps.get(name)
        if mm is not None:
            # The driver must not keep a registration of memory that is gone: a later mapping
            # at the same address could not be registered (and every expert would run on the
            # CPU). Not at interpreter exit: the process's memory goes with it.
            fin = weakref.finalize(mm, _unregister_host, ptr)
            fin.atexit = False
            self._unpin_at_free[name] = fin
        return True

    def unpin(self) -> None:
        """Unregister every pinned bank (no-op when none is)."""
        if self._pinned_banks:
            cudart = torch.cuda.cudart()
            for name in self._pinned_banks:
                fin = self._unpin_at_free.pop(name, None)
                if fin is not None:
                    fin.detach()
                cudart.cudaHostUnregister(_storage_span(self.tensors[name])[0])
        self._pinned_banks = set()
        self._registered = False
