"""Recording of routing traces (``--expert-cache-record-routing PATH``).

One JSON line per MoE layer call::

    {"step": 12, "layer": 3, "phase": "decode", "tokens": 4, "experts": [1, 7, ...],
     "counts": [2, 1, ...], "num_experts": 64, "num_layers": 4}

``experts`` are the distinct layer-local routed ids of the call (sorted), ``counts`` the tokens
routed to each; ``step`` counts forward passes (it advances when a layer id is not above the
previous call's); ``phase`` is the forward mode of the batch (``prefill`` for extend/mixed
batches). ``benchmark/expert_cache/bench_missrate.py --trace PATH`` replays such a file.
"""

from __future__ import annotations

import atexit
import json
import threading
from typing import Optional

import torch


def forward_phase() -> Optional[str]:
    """``decode`` or ``prefill`` (extend or mixed) for the batch of the server forward being
    run, read from the forward batch published in SGLang's forward context (its MoE padding
    getter is a bound method of the batch); None outside a server forward."""
    try:
        from sglang.srt.model_executor.forward_context import (
            get_forward_context,
            has_forward_context,
        )

        if has_forward_context():
            batch = getattr(get_forward_context().moe_num_token_non_padded, "__self__", None)
            mode = getattr(batch, "forward_mode", None)
            if mode is not None:
                return "decode" if mode.is_decode() else "prefill"
    except ImportError:
        pass
    return None


def current_phase(num_tokens: int) -> str:
    """:func:`forward_phase`; outside a server forward, a call of one token is taken as
    decode."""
    return forward_phase() or ("decode" if num_tokens == 1 else "prefill")


class RoutingRecorder:
    """Appends routing records to ``path`` (line-buffered writes, flushed at exit).

    Raises:
        OSError: the file cannot be opened for appending (at server start, so the user sees it).
    """

    def __init__(self, path: str, num_experts: int, num_layers: int):
        self.file = open(path, "a", buffering=1 << 16)
        self.num_experts = num_experts
        self.num_layers = num_layers
        self.step = 0
        self._last_layer: Optional[int] = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def record(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Append the call of ``layer_id`` routing ``topk_ids`` ([T, K], -1 = padding)."""
        if self._last_layer is not None and layer_id <= self._last_layer:
            self.step += 1
        self._last_layer = layer_id
        ids = topk_ids[topk_ids >= 0].to("cpu")
        experts, counts = torch.unique(ids, return_counts=True)
        line = json.dumps(
            {
                "step": self.step,
                "layer": layer_id,
                "phase": current_phase(int(topk_ids.shape[0])),
                "tokens": int(topk_ids.shape[0]),
                "experts": experts.tolist(),
                "counts": counts.tolist(),
                "num_experts": self.num_experts,
                "num_layers": self.num_layers,
            }
        )
        with self._lock:
            self.file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if not self.file.closed:
                self.file.close()
