"""``--quant nvfp4`` for ``--arch qwen3_5_moe``: the layout of nvidia/Qwen3.6-35B-A3B-NVFP4.

That release is not a plain ModelOpt ``NVFP4`` export (:mod:`.quantize_nvfp4`, the layout of
nvidia/Qwen3-30B-A3B-FP4) but a ModelOpt ``MIXED_PRECISION`` one: each quantized module is
listed with its own ``quant_algo`` in ``quantized_layers``. What the sources establish (see the
tiny_models README for which points are confirmed and which inferred, with the sources):

* ``config.json`` carries ``quantization_config`` = ``{"quant_method": "modelopt",
  "quant_algo": "MIXED_PRECISION", "kv_cache_scheme": null, "quantized_layers": {...},
  "ignore": [...], "producer": {...}}``, keys of ``quantized_layers`` named as the checkpoint
  names them (``model.language_model.layers.N.*``, ``lm_head``); ``hf_quant_config.json``
  repeats the map under ``quantization`` with ``kv_cache_quant_algo: "FP8"`` (the FP8 KV cache
  is only declared there; the release ships no ``k_scale`` / ``v_scale`` tensors);
* routed experts (``mlp.experts``, one entry per layer, stored per expert as
  ``mlp.experts.{j}.{gate,up,down}_proj``), the shared expert's three projections and
  ``lm_head``: ``W4A16_NVFP4``, group 16 -- ``weight`` uint8 ``[N, K/2]``, ``weight_scale``
  float8_e4m3fn ``[N, K/16]``, ``weight_scale_2`` float32 ``[]``, and no ``input_scale``
  (weight-only: activations stay 16-bit);
* full attention ``self_attn.{q,k,v,o}_proj`` and the gated DeltaNet's large projections
  ``linear_attn.{in_proj_qkv,in_proj_z,out_proj}``: ``FP8`` per tensor -- ``weight``
  float8_e4m3fn ``[N, K]``, ``weight_scale`` float32 ``[]`` (``amax / 448``), ``input_scale``
  float32 ``[]`` (static W8A8);
* bf16 and listed in ``ignore``: the MoE router ``mlp.gate``, ``mlp.shared_expert_gate``,
  ``linear_attn.in_proj_a`` / ``in_proj_b`` / ``conv1d``, the vision tower ``model.visual*`` and
  the MTP head ``mtp*``; the embedding and norms are not Linear modules and stay bf16 unlisted.

Projections fused at serving time share their per-tensor scales (the max over them), as
ModelOpt's exporter gives them (q/k/v; an expert's or the shared expert's gate/up; the
DeltaNet's ``in_proj_qkv`` / ``in_proj_z``, which upstream loads as one ``in_proj_qkvz``). The
tiny model is not calibrated: every FP8 ``input_scale`` is that of an activation amax of
:data:`.quantize_nvfp4.INPUT_AMAX`.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from .quantize_nvfp4 import E2M1_MAX, E4M3_MAX, GROUP, INPUT_AMAX, nvfp4_quantize

MODELOPT_VERSION = "0.44.0"  # the release's model card names Model Optimizer v0.44.0
NVFP4_ALGO = "W4A16_NVFP4"
FP8_ALGO = "FP8"
# Projections fused at serving time (they share weight_scale(_2) and input_scale).
FUSED = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("in_proj_qkv", "in_proj_z"),
)
FP8_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj")
TEXT = "model.language_model."


def mixed_quant_algo(name: str):
    """The ``quant_algo`` the release gives the tensor ``name`` (a ``*.weight``), or None for
    one it keeps in bf16."""
    if not name.endswith(".weight") or not name.startswith((TEXT + "layers.", "lm_head.")):
        return None
    module = name[: -len(".weight")]
    proj = module.rsplit(".", 1)[-1]
    if module == "lm_head" or ".mlp.experts." in module or ".mlp.shared_expert." in module:
        return NVFP4_ALGO
    if proj in FP8_PROJS and (".self_attn." in module or ".linear_attn." in module):
        return FP8_ALGO
    return None


def _fusion_key(module: str) -> str:
    if "." not in module:  # lm_head
        return module
    parent, proj = module.rsplit(".", 1)
    for group in FUSED:
        if proj in group:
            return f"{parent}.{'+'.join(group)}"
    return module


def _layer_key(module: str) -> str:
    """The ``quantized_layers`` key of ``module``: routed experts are listed once per layer."""
    head, sep, _ = module.partition(".mlp.experts.")
    return head + ".mlp.experts" if sep else module


def _ignored(cfg: dict) -> List[str]:
    text = cfg["text_config"]
    out = []
    for i in range(text["num_hidden_layers"]):
        p = f"{TEXT}layers.{i}."
        if text["layer_types"][i] == "linear_attention":
            out += [
                p + "linear_attn.conv1d",
                p + "linear_attn.in_proj_a",
                p + "linear_attn.in_proj_b",
            ]
        out += [p + "mlp.gate", p + "mlp.shared_expert_gate"]
    return out + ["model.visual*", "mtp*"]


def quantize_state_qwen3_5_nvfp4(state: Dict[str, object], cfg: dict) -> Tuple[Dict, dict, dict]:
    """``(state, config, hf_quant_config)`` of the nvidia/Qwen3.6-35B-A3B-NVFP4-layout checkpoint
    made from a bf16 tiny ``qwen3_5_moe`` (``config`` gains ``quantization_config``).

    Raises:
        ValueError: a quantized projection whose K is not a multiple of 16.
    """
    import torch

    algos = {n: a for n in state if (a := mixed_quant_algo(n)) is not None}
    amax: Dict[str, float] = {}
    for n in algos:
        key = _fusion_key(n[: -len(".weight")])
        amax[key] = max(amax.get(key, 0.0), float(state[n].float().abs().max()))
    out = dict(state)
    layers: Dict[str, dict] = {}
    for n, algo in algos.items():
        module = n[: -len(".weight")]
        a = max(amax[_fusion_key(module)], 1e-12)
        if algo == NVFP4_ALGO:
            g = torch.tensor(a / (E2M1_MAX * E4M3_MAX), dtype=torch.float32)
            w, s = nvfp4_quantize(state[n], float(g))
            out[n], out[module + ".weight_scale"], out[module + ".weight_scale_2"] = w, s, g
            layers[_layer_key(module)] = {"group_size": GROUP, "quant_algo": NVFP4_ALGO}
        else:
            scale = torch.tensor(a / E4M3_MAX, dtype=torch.float32)
            q = (state[n].float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            out[n], out[module + ".weight_scale"] = q.contiguous(), scale
            out[module + ".input_scale"] = torch.tensor(INPUT_AMAX / E4M3_MAX)
            layers[module] = {"quant_algo": FP8_ALGO}
    layers = dict(sorted(layers.items()))
    ignore = _ignored(cfg)
    producer = {"name": "modelopt", "version": MODELOPT_VERSION}
    qcfg = {
        "ignore": ignore,
        "kv_cache_scheme": None,
        "producer": producer,
        "quant_algo": "MIXED_PRECISION",
        "quant_method": "modelopt",
        "quantized_layers": layers,
    }
    hf_quant = {
        "producer": producer,
        "quantization": {
            "exclude_modules": ignore,
            "kv_cache_quant_algo": "FP8",
            "quant_algo": "MIXED_PRECISION",
            "quantized_layers": layers,
        },
    }
    cfg = dict(cfg)
    cfg["quantization_config"] = qcfg
    return dict(sorted(out.items())), dict(sorted(cfg.items())), hf_quant


def fp8_dequantize(weight, weight_scale, dtype=None):
    """``fp8 * weight_scale``: [N, K] in ``dtype`` (default float64) from float8_e4m3fn [N, K]
    and a float32 scalar."""
    import torch

    dtype = dtype or torch.float64
    return weight.to(dtype) * weight_scale.to(dtype)


def dequantize_mixed_checkpoint(src, dst, dtype=None):
    """Write the ``MIXED_PRECISION`` checkpoint ``src`` dequantized into ``dst``: each
    ``W4A16_NVFP4`` weight replaced by :func:`.quantize_nvfp4.nvfp4_dequantize` and each ``FP8``
    one by :func:`fp8_dequantize` (float64, then ``dtype``, default float32), their scales
    dropped, every other tensor as stored; ``config.json`` without ``quantization_config`` and
    no ``hf_quant_config.json``; the other files copied. The oracle's checkpoint: transformers
    loads it as the unquantized model whose weights the server computes with.

    Returns:
        ``dst`` as a ``Path``.

    Raises:
        ValueError: ``src`` is not a ModelOpt ``MIXED_PRECISION`` checkpoint, or a quantized
            weight lacks a scale (names it).
    """
    import json
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    from .quantize_nvfp4 import nvfp4_dequantize

    src, dst = Path(src), Path(dst)
    dtype = dtype or torch.float32
    cfg = json.loads((src / "config.json").read_text())
    q = cfg.pop("quantization_config", None) or {}
    if q.get("quant_algo") != "MIXED_PRECISION":
        raise ValueError(f"{src}: quantization_config {q!r} is not ModelOpt MIXED_PRECISION")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in (
            "config.json",
            "model.safetensors",
            "hf_quant_config.json",
        ):
            shutil.copy(f, dst / f.name)
    state = load_file(str(src / "model.safetensors"))
    scales = (".weight_scale", ".weight_scale_2", ".input_scale")
    out = {}
    for name, t in state.items():
        if name.endswith(scales):
            continue
        module = name[: -len(".weight")]
        try:
            if t.dtype == torch.uint8:
                t = nvfp4_dequantize(
                    t, state[module + ".weight_scale"], state[module + ".weight_scale_2"]
                )
            elif t.dtype == torch.float8_e4m3fn:
                t = fp8_dequantize(t, state[module + ".weight_scale"])
            else:
                out[name] = t.contiguous()
                continue
        except KeyError as e:
            raise ValueError(f"{name}: a quantized weight without {e.args[0]}") from e
        out[name] = t.to(dtype).contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dst
