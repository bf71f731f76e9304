"""The MXFP4 expert layout of OpenAI's gpt-oss releases (openai/gpt-oss-20b), for the tiny gpt-oss.

What the releases hold per MoE layer ``model.layers.N.mlp.experts.`` (and what transformers'
``integrations/mxfp4.py`` ``convert_moe_packed_tensors`` and upstream SGLang's ``Mxfp4MoEMethod``
read), for ``P`` in ``gate_up_proj`` / ``down_proj``:

* ``P_blocks`` uint8 ``[E, N, K / 32, 16]``: two e2m1 codes per byte, element ``2j`` of a
  32-group in the low nibble, ``2j + 1`` in the high nibble (sign in bit 3; magnitudes 0, 0.5,
  1, 1.5, 2, 3, 4, 6);
* ``P_scales`` uint8 ``[E, N, K / 32]``: the e8m0 scale of each 32-group, ``2 ** (s - 127)``;
* ``P_bias`` bf16 ``[E, N]`` (not quantized).

N is the output rows (``2 * intermediate`` for gate_up, gate and up interleaved: row ``2i`` is
gate row ``i``, ``2i + 1`` up row ``i``; ``hidden`` for down), K the input. The dequantized
weight is ``e2m1 * 2 ** (s - 127)``; transformers keeps it transposed, ``[E, K, N]``
(``GptOssExperts.gate_up_proj`` [E, hidden, 2 * intermediate]), which is the layout the
builder makes the float experts in. ``config.json`` carries ``quantization_config``
``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}`` as the releases do.
"""

from __future__ import annotations

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7; bit 3 is the sign
E2M1_MAX = 6.0
# openai/gpt-oss-20b's config.json quantization_config
MODULES_NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


def mxfp4_quantize(w):
    """Quantize weights to MXFP4 in the gpt-oss layout.

    Args:
        w: [E, N, K] float tensor (rows = outputs), K a multiple of 32.

    Returns:
        ``(blocks, scales)``: uint8 [E, N, K/32, 16], uint8 [E, N, K/32]. Each group's scale is
        the smallest power of two ``2**e`` with ``amax / 2**e <= 6`` (e in [-127, 127]), each
        element the nearest e2m1 of ``w / 2**e`` (a tie to the smaller magnitude).

    Raises:
        ValueError: K not a multiple of 32.
    """
    import torch

    e, n, k = w.shape
    if k % GROUP:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {GROUP}, got {k}")
    g = w.float().reshape(e, n, k // GROUP, GROUP)
    amax = g.abs().amax(-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-127, 127)
    x = g / torch.exp2(exp).unsqueeze(-1)
    vals = torch.tensor(E2M1_VALUES)
    mag = (x.abs().unsqueeze(-1) - vals).abs()
    # nearest magnitude, ties to the smaller one (argmin takes the first)
    idx = mag.argmin(-1).to(torch.uint8)
    code = idx | ((x < 0).to(torch.uint8) << 3)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (exp + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def mxfp4_dequantize(blocks, scales):
    """[E, N, G, 16] uint8 codes, [E, N, G] uint8 e8m0 scales -> [E, N, G * 32] float32."""
    import torch

    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    lo, hi = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], -1).flatten(-2)
    w = vals * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return w.flatten(-2)


def quantize_experts(state: dict) -> dict:
    """Replace each layer's float ``mlp.experts.gate_up_proj`` [E, H, 2I] and ``down_proj``
    [E, I, H] (transformers' dequantized layout) by the release's ``_blocks`` / ``_scales``;
    the biases stay bf16. Returns a new dict."""
    out = {}
    for name, t in state.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales = mxfp4_quantize(t.transpose(1, 2))
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        else:
            out[name] = t
    return out


SWIGLU_ALPHA = 1.702  # transformers' GptOssConfig.swiglu_alpha
SWIGLU_LIMIT = 7.0  # config.json "swiglu_limit"


def gpt_oss_moe_reference(x, state: dict, prefix: str, top_k: int, limit: float = SWIGLU_LIMIT):
    """float64 reference of one gpt-oss MoE block, from the checkpoint tensors.

    Follows transformers' ``GptOssTopKRouter`` (logits = x W^T + b; top-k of the logits, softmax
    over the k) and ``GptOssExperts`` (gate/up interleaved rows; ``g`` clamped to at most
    ``limit``, ``u`` to [-limit, limit]; ``(u + 1) * g * sigmoid(alpha * g)``; biases added after
    each projection).

    Args:
        x: [T, H] float tensor (the post-attention-norm hidden states).
        state: checkpoint tensors (``{prefix}router.weight`` [E, H], ``router.bias`` [E],
            ``experts.{gate_up,down}_proj_{blocks,scales,bias}`` as in the module docstring).
        prefix: ``"model.layers.N.mlp."``.
        top_k: experts per token.
        limit: ``swiglu_limit``.

    Returns:
        [T, H] float64.
    """
    import torch

    x = x.double()
    logits = x @ state[prefix + "router.weight"].double().T + state[prefix + "router.bias"].double()
    top_val, top_idx = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(top_val, dim=-1)
    return gpt_oss_experts_reference(x, state, prefix, top_idx, weights, limit)


def gpt_oss_experts_reference(
    x,
    state: dict,
    prefix: str,
    top_idx,
    weights,
    limit: float = SWIGLU_LIMIT,
    alpha: float = SWIGLU_ALPHA,
):
    """float64 expert part of :func:`gpt_oss_moe_reference`, for a given routing.

    ``out[t] = sum_j weights[t, j] * (W2[e] @ h + b2[e])`` with ``e = top_idx[t, j]``,
    ``gu = W13[e] @ x[t] + b13[e]`` (rows interleaved: gate ``gu[0::2]``, up ``gu[1::2]``),
    ``h = (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')``, ``g' = min(g, limit)``
    (transformers' ``GptOssExperts``), W dequantized from the checkpoint's MXFP4 blocks.

    Args:
        x: [T, H] float tensor.
        state, prefix: as :func:`gpt_oss_moe_reference`.
        top_idx: [T, K] integer expert ids; weights: [T, K] float routing weights.
        limit, alpha: ``swiglu_limit`` / ``swiglu_alpha``.

    Returns:
        [T, H] float64.
    """
    import torch

    x = x.double()
    weights = weights.double()
    top_k = top_idx.shape[1]
    e = prefix + "experts."
    w13 = mxfp4_dequantize(state[e + "gate_up_proj_blocks"], state[e + "gate_up_proj_scales"])
    w2 = mxfp4_dequantize(state[e + "down_proj_blocks"], state[e + "down_proj_scales"])
    b13, b2 = state[e + "gate_up_proj_bias"].double(), state[e + "down_proj_bias"].double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            k = int(top_idx[t, j])
            gu = w13[k].double() @ x[t] + b13[k]
            g, u = gu[0::2].clamp(max=limit), gu[1::2].clamp(-limit, limit)
            h = (u + 1) * g * torch.sigmoid(alpha * g)
            out[t] += weights[t, j] * (w2[k].double() @ h + b2[k])
    return out
