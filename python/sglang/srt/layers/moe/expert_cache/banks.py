"""Expert banks: the routed-expert tensors of every MoE layer in one runtime layout.

A bank is one tensor whose leading dimension is the flattened expert id
``g = layer * num_experts + expert`` (FreeToken §4.2, "Expert banks"); the rows with one id
across all banks form one complete expert. The host pool (all experts, the source of truth)
and the device slots (the cache) use the same bank layout, so one (source id, destination
slot) work list copies an expert across every bank, and the CPU executor and the device
kernels index experts the same way.

BF16 is defined here; the quantized formats (FP8, MXFP4, NVFP4: packed weights plus scale
banks, with their float64 dequantize references) are the :class:`ExpertFormat` subclasses of
``formats.py``. The cache, the control step and the copy work list only see rows and never
change.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Dict, Tuple

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
    """How one complete expert is stored: its banks, for a given expert shape."""

    label: str
    dtype: torch.dtype

    def banks(self, hidden_size: int, intermediate_size: int) -> Tuple[BankSpec, ...]:
        """The banks of an expert with ``hidden_size`` H and ``intermediate_size`` I:
        ``w13`` [2I, H] (gate rows then up rows, SGLang's ``w13_weight``) and ``w2`` [H, I]."""
        h, i = hidden_size, intermediate_size
        return (
            BankSpec("w13", "w13_weight", (2 * i, h), self.dtype),
            BankSpec("w2", "w2_weight", (h, i), self.dtype),
        )

    @property
    def executor_format(self) -> str:
        """The CPU executor's ``format`` name for these banks (``sgl_kernel_fork.cpu_executor``)."""
        return "bf16"


BF16 = ExpertFormat(label="bf16", dtype=torch.bfloat16)
FORMATS = {BF16.dtype: BF16}


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


class ExpertBanks:
    """``rows`` experts in every bank of ``fmt``, on ``device``.

    Host banks are allocated with ``torch.empty``: pages are touched only when a row is
    written, so rows of dense layers (never loaded) cost no memory. Pinning, when a GPU
    copies from them, happens after the rows are filled (:meth:`pin`), as FreeToken §3.3
    prescribes: pinning empty buffers would fault in and zero every page first.
    """

    def __init__(
        self,
        fmt: ExpertFormat,
        hidden_size: int,
        intermediate_size: int,
        rows: int,
        device: torch.device | str,
    ):
        self.format = fmt
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.specs = fmt.banks(hidden_size, intermediate_size)
        self.rows = rows
        self.device = torch.device(device)
        self.tensors: Dict[str, torch.Tensor] = {
            s.name: torch.empty((rows, *s.row_shape), dtype=s.dtype, device=self.device)
            for s in self.specs
        }
        self._registered = False

    @property
    def expert_bytes(self) -> int:
        """Bytes of one complete expert across all banks."""
        return sum(
            math.prod(s.row_shape) * torch.empty((), dtype=s.dtype).element_size()
            for s in self.specs
        )

    def bank_list(self):
        """The bank tensors in spec order (the order every op receives them in)."""
        return [self.tensors[s.name] for s in self.specs]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def pin(self) -> bool:
        """Page-lock the host banks in place so copies to a GPU run at full bandwidth.

        Returns:
            True when pinned (also when already pinned, e.g. a pool shared by several caches);
            False when there is no CUDA or the driver refused (the caller falls back to running
            every expert on the CPU, paper §4.2 "Platform adaptation").
        """
        if self.device.type != "cpu" or not torch.cuda.is_available():
            return False
        if self._registered:
            return True
        cudart = torch.cuda.cudart()
        for name, t in self.tensors.items():
            err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(err) != 0:
                logger.warning(
                    "Expert cache: could not pin the %s host bank (%.2f GB, cudaError %s)",
                    name,
                    t.numel() * t.element_size() / 1e9,
                    int(err),
                )
                self.unpin()
                return False
            self._registered = True
        return True

    def unpin(self) -> None:
        if self._registered:
            cudart = torch.cuda.cudart()
            for t in self.tensors.values():
                cudart.cudaHostUnregister(t.data_ptr())
            self._registered = False
