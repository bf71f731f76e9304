"""Independent references for the sgl_kernel CPU-op tests.

transformers' own torch implementation of Qwen3-Next
(``transformers.models.qwen3_next.modeling_qwen3_next``), unwrapped with
``inspect.unwrap`` so that no hub kernel or optional package (fla,
causal-conv1d) can stand in for it.
"""

import inspect

import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf


def _unwrap(name):
    fn = inspect.unwrap(getattr(hf, name))
    assert fn.__code__.co_filename.endswith("modeling_qwen3_next.py"), fn
    return fn


ref_chunk_gated_delta_rule = _unwrap("torch_chunk_gated_delta_rule")
ref_recurrent_gated_delta_rule = _unwrap("torch_recurrent_gated_delta_rule")
ref_causal_conv1d_update = _unwrap("causal_conv1d_update")
ref_causal_conv1d_fn = _unwrap("causal_conv1d_fn")
RefRMSNormGated = hf.Qwen3NextRMSNormGated


def ref_gating(A_log, a, b, dt_bias):
    """The gating lines of Qwen3NextGatedDeltaNet.forward."""
    beta = b.sigmoid()
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    return g, beta


def expand_heads(x, num_v_heads):
    """[B, T, H, D] -> [B, T, HV, D] as the model does (repeat_interleave)."""
    rep = num_v_heads // x.shape[2]
    return x.repeat_interleave(rep, dim=2) if rep > 1 else x
