"""A custom logit processor that makes a request generate a given token sequence.

Tests and benchmarks need a tiny random-weights model to generate particular text (a reasoning
block, a tool call) so that what the server does with generated markers can be checked. The
model still runs every step on the forced tokens, exactly as on tokens it chose itself, so the
recurrent state and KV after them are the model's own.

Usage (server started with ``--enable-custom-logit-processor``)::

    {"input_ids": [...], "custom_logit_processor": ScriptedTokens.to_str(),
     "sampling_params": {"custom_params": {"script": [id0, id1, ...]}, ...}}

Output token ``k`` is ``script[k]`` while ``k < len(script)``; after that the model's logits
are left as they are.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class ScriptedTokens(CustomLogitProcessor):
    """Forces output token ``k`` of each row to ``custom_params["script"][k]``.

    ``logits``: [rows, vocab] float; ``custom_param_list``: one dict per row with ``script``
    (list of token ids) and ``__req__`` (set by the scheduler). Returns ``logits`` with each
    scripted row set to -inf except 0 at the scripted id. Rows without a script are unchanged.
    """

    def __call__(
        self, logits: torch.Tensor, custom_param_list: Optional[List[Dict[str, Any]]] = None
    ) -> torch.Tensor:
        for row, params in enumerate(custom_param_list or []):
            if not params or not params.get("script") or params.get("__req__") is None:
                continue
            script, k = params["script"], len(params["__req__"].output_ids)
            if k < len(script):
                logits[row, :] = -float("inf")
                logits[row, int(script[k])] = 0.0
        return logits
