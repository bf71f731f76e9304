"""``--quant nvfp4``: the layout of NVIDIA's ModelOpt NVFP4 releases (nvidia/Qwen3-30B-A3B-FP4).

What upstream 0.5.23's ModelOpt loader reads (``ModelOptFp4LinearMethod`` /
``ModelOptNvFp4FusedMoEMethod.create_weights`` in ``layers/quantization/modelopt_quant.py``) and
the releases hold, per quantized projection ``P`` (every decoder ``*_proj``: attention q/k/v/o,
each routed expert's gate/up/down, dense and shared-expert MLPs):

* ``P.weight`` uint8 ``[N, K / 2]``: two e2m1 codes per byte, element ``2j`` in the low nibble
  (sign in bit 3; values 0, 0.5, 1, 1.5, 2, 3, 4, 6);
* ``P.weight_scale`` float8_e4m3fn ``[N, K / 16]``: one scale per 16 elements along K;
* ``P.weight_scale_2`` float32 ``[]``: the per-tensor global scale, ``amax(|w|) / (6 * 448)``;
* ``P.input_scale`` float32 ``[]``: the activations' global scale, ``amax(|x|) / (6 * 448)``
  from calibration (W4A4 kernels quantize activations with it).

The weight is ``e2m1 * weight_scale * weight_scale_2`` (:func:`nvfp4_dequantize`). ModelOpt gives
projections that read the same input and are fused at serving time (q/k/v; gate/up of one MLP or
expert) one common ``weight_scale_2`` and ``input_scale`` (the max over them), which upstream
relies on (it keeps one global per fused linear, and warns when an expert's gate and up differ);
so does this quantizer. Not quantized: the embedding, ``lm_head``, the norms and the MoE router
(``mlp.gate``), listed in ``exclude_modules`` as ModelOpt lists its disabled quantizers.

``config.json`` is unchanged; the quantization is described in ``hf_quant_config.json``
(``{"producer": {"name": "modelopt", ...}, "quantization": {"quant_algo": "NVFP4",
"kv_cache_quant_algo": null, "group_size": 16, "exclude_modules": [...]}}``), which upstream's
``ModelConfig`` finds beside a checkpoint whose ``config.json`` has no ``quantization_config``.
The tiny model is not calibrated: every ``input_scale`` is that of an activation amax of
:data:`INPUT_AMAX`; weight-only execution (this CPU) does not read it.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

GROUP = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7; bit 3 is the sign
E2M1_MAX = 6.0
E4M3_MAX = 448.0
INPUT_AMAX = 8.0
MODELOPT_VERSION = "0.33.0"  # the producer recorded in hf_quant_config.json
# Projections fused at serving time: they share weight_scale_2 and input_scale.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def nvfp4_quantize(w, global_scale: float):
    """Quantize one weight to NVFP4 with the given per-tensor global scale.

    Args:
        w: [N, K] float tensor, K a multiple of 16.
        global_scale: ``weight_scale_2`` (float32 value), ``amax / (6 * 448)`` of the tensors
            sharing it.

    Returns:
        ``(weight, weight_scale)``: uint8 [N, K/2] packed codes, float8_e4m3fn [N, K/16], with
        each 16-group's scale ``amax(group) / 6 / global`` rounded to e4m3 and each element
        the nearest e2m1 of ``w / (scale * global)`` (a tie to the smaller magnitude).

    Raises:
        ValueError: K not a multiple of 16.
    """
    import torch

    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"NVFP4 needs K a multiple of {GROUP}, got {tuple(w.shape)}")
    g = w.float().view(n, k // GROUP, GROUP)
    scale = (g.abs().amax(-1) / E2M1_MAX / global_scale).clamp(max=E4M3_MAX)
    scale = scale.to(torch.float8_e4m3fn)
    eff = scale.float() * global_scale
    q = (g / torch.where(eff > 0, eff, 1.0)[..., None]).clamp(-E2M1_MAX, E2M1_MAX)
    mids = torch.tensor([(a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:])])
    mag = torch.bucketize(q.abs(), mids)  # nearest value; a tie goes to the smaller one
    codes = (mag | torch.where(q < 0, 8, 0)).to(torch.uint8).view(n, k)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(), scale.contiguous()


def nvfp4_dequantize(weight, weight_scale, weight_scale_2, dtype=None):
    """``e2m1 * weight_scale * weight_scale_2``: [N, K] in ``dtype`` (default float64, the
    reference), from uint8 [N, K/2], float8_e4m3fn [N, K/16] and a float32 scalar."""
    import torch

    dtype = dtype or torch.float64
    codes = torch.stack([weight & 15, weight >> 4], dim=-1).flatten(-2).long()
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    v = lut[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    s = weight_scale.double().repeat_interleave(GROUP, dim=-1) * weight_scale_2.double()
    return (v * s).to(dtype)


def nvfp4_quantized_names(state: Dict[str, object]) -> List[str]:
    """The projections the releases quantize: 2-D ``*_proj.weight`` (the router ``mlp.gate``,
    embeddings, ``lm_head`` and norms are not projections of that name)."""
    return [n for n, t in state.items() if n.endswith("_proj.weight") and t.dim() == 2]


def _fusion_group(name: str) -> str:
    """The key shared by the projections fused with ``name`` (a ``*_proj.weight``)."""
    module = name[: -len(".weight")]
    parent, proj = module.rsplit(".", 1)
    for group in FUSED:
        if proj in group:
            return f"{parent}.{'+'.join(group)}"
    return module


def quantize_state_nvfp4(state: Dict[str, object], cfg: dict) -> Tuple[Dict, dict]:
    """``(state, hf_quant_config)`` of the NVFP4 checkpoint made from a bf16 tiny model."""
    import torch

    names = nvfp4_quantized_names(state)
    amax: Dict[str, float] = {}
    for n in names:
        key = _fusion_group(n)
        amax[key] = max(amax.get(key, 0.0), float(state[n].float().abs().max()))
    out = dict(state)
    for n in names:
        module = n[: -len(".weight")]
        g = torch.tensor(max(amax[_fusion_group(n)], 1e-12) / (E2M1_MAX * E4M3_MAX))
        w, s = nvfp4_quantize(state[n], float(g))
        out[n] = w
        out[module + ".weight_scale"] = s
        out[module + ".weight_scale_2"] = g.float()
        out[module + ".input_scale"] = torch.tensor(INPUT_AMAX / (E2M1_MAX * E4M3_MAX))
    exclude = ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(cfg["num_hidden_layers"])]
    hf_quant = {
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "quantization": {
            "exclude_modules": exclude,
            "group_size": GROUP,
            "kv_cache_quant_algo": None,
            "quant_algo": "NVFP4",
        },
    }
    return dict(sorted(out.items())), hf_quant
