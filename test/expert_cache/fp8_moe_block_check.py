"""A block-FP8 Qwen3-MoE block (upstream's ``Qwen3MoeSparseMoeBlock``) built several ways on
the CPU, with upstream's ``Fp8Config`` read from the tiny FP8 checkpoint's ``config.json``.

Run by ``test_fp8_moe_layer.py`` in a fresh process (runtime context, gloo group). Arguments:
the tiny ``qwen3_moe`` FP8 model folder (``sglang.test.tiny_models --quant fp8``) and an output
file. The block of layer ``LAYER`` is loaded through upstream's weight loaders in each
configuration of :data:`CONFIGS` (``stock``: ``Fp8MoEMethod`` without the cache, on this CPU
the CPU executor through patch 0003; the others ``--enable-expert-cache`` at several sizes and
policies) and runs ``forward_normal`` on the batches of :data:`CALLS`.

Recorded per cache configuration: the outputs, the counters, whether every host-pool bank row
of the layer holds the checkpoint's bytes (FP8 weights as stored, scales as float32 of the
stored bf16) and whether every slot holds the bytes of the host row it caches, after the calls.
Recorded once: a float64 reference of the block (router, top-k renormalized, experts with
``fp8 * scale_inv`` dequantized weights) and the same reference with the scales dropped, and
the errors of three broken checkpoints (a missing expert scale, a mis-shaped expert scale, a
mis-shaped attention scale) and of a QKV linear without its scales.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from moe_block_util import load_block, publish_cpu_server, run_configs, start_group  # noqa: E402

CALLS = (1, 3, 37, 2, 64)
LAYER = 1
BANDWIDTHS = dict(expert_cache_fill_gbps=10.0, expert_cache_cpu_gbps=20.0)  # q*/m = 0.5
CONFIGS = {
    "stock": {},
    "resident": dict(expert_cache_size="100%", expert_cache_policy="fill"),
    "slots8_qstar": dict(expert_cache_size="8", expert_cache_policy="qstar"),
    "slots8_cpu": dict(expert_cache_size="8", expert_cache_policy="cpu"),
    "slots16_fill": dict(expert_cache_size="16", expert_cache_policy="fill"),
    "slots50pct_qstar": dict(expert_cache_size="50%", expert_cache_policy="qstar"),
}
PREFIX = f"model.layers.{LAYER}.mlp."
BROKEN_EXPERT = f"{PREFIX}experts.5.up_proj.weight_scale_inv"


def _build(cfg, quant_config, state: dict):
    from sglang.srt.models.qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.set_default_dtype(torch.bfloat16)
    try:
        block = Qwen3MoeSparseMoeBlock(
            layer_id=LAYER, config=cfg, quant_config=quant_config, prefix=PREFIX.rstrip(".")
        )
    finally:
        torch.set_default_dtype(torch.float32)
    load_block(block, state, PREFIX, cfg.num_experts)
    block.experts.quant_method.process_weights_after_loading(block.experts)
    return block


def _checkpoint_rows(state: dict, e: int) -> dict:
    """One expert's checkpoint tensors in the bank layout (w13 = gate rows then up rows)."""
    x = f"{PREFIX}experts.{e}."

    def cat(suffix):
        return torch.cat([state[x + "gate_proj." + suffix], state[x + "up_proj." + suffix]])

    return {
        "w13": cat("weight"),
        "w2": state[x + "down_proj.weight"],
        "w13_scale": cat("weight_scale_inv").float(),
        "w2_scale": state[x + "down_proj.weight_scale_inv"].float(),
    }


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _pool_checks(cache, state: dict, num_experts: int) -> dict:
    host_ok = all(
        _same_bytes(cache.host[name][LAYER * num_experts + e], want)
        for e in range(num_experts)
        for name, want in _checkpoint_rows(state, e).items()
    )
    ids = cache.tables.id_of_slot.tolist()
    slots_ok = all(
        _same_bytes(cache.slots[name][s], cache.host[name][g])
        for s, g in enumerate(ids)
        if g >= 0
        for name in cache.host.tensors
    )
    return {
        "host_bytes_match_checkpoint": host_ok,
        "slots_hold_host_bytes": slots_ok,
        "banks": {n: (str(t.dtype), tuple(t.shape)) for n, t in cache.host.tensors.items()},
        "format": cache.format.label,
    }


def _reference(cfg, state: dict, xs, with_scales: bool = True):
    """float64 block output: softmax router (experts picked from the bf16 router logits, as the
    block picks them), top-k renormalized, dequantized experts."""
    from sglang.test.tiny_models.quantize import block_dequantize_fp8

    def w(name):
        q = state[name + ".weight"]
        if not with_scales:
            return q.to(torch.float64)
        return block_dequantize_fp8(q, state[name + ".weight_scale_inv"])

    gate_bf16 = state[PREFIX + "gate.weight"]
    gate = gate_bf16.double()
    experts = {}
    outs = []
    for x in xs:
        xd = x.double()
        # Which experts: chosen from the router logits as the block computes them (a bf16
        # linear), so a near-tie is not decided differently by float64 and one token's whole
        # output does not differ; their weights: float64 softmax, top-k renormalized.
        logits_bf16 = torch.nn.functional.linear(x.to(gate_bf16.dtype), gate_bf16).float()
        top_i = torch.softmax(logits_bf16, dim=-1).topk(cfg.num_experts_per_tok, dim=-1).indices
        probs = torch.softmax(xd @ gate.T, dim=-1)
        top_w = probs.gather(-1, top_i)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        out = torch.zeros_like(xd)
        for t in range(xd.shape[0]):
            for k in range(top_i.shape[1]):
                e = int(top_i[t, k])
                if e not in experts:
                    p = f"{PREFIX}experts.{e}."
                    experts[e] = tuple(w(p + n) for n in ("gate_proj", "up_proj", "down_proj"))
                g, u, d = experts[e]
                h = torch.nn.functional.silu(g @ xd[t]) * (u @ xd[t])
                out[t] += top_w[t, k] * (d @ h)
        outs.append(out)
    return outs


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return ""


def _qkv_linear_case(cfg, quant_config, state: dict, drop_scale: bool, bad_scale: bool):
    """A QKV linear of layer ``LAYER`` in FP8 loaded from the checkpoint, post-processed by
    upstream's Fp8LinearMethod (patch 0003 on this CPU); returns (layer, error)."""
    from sglang.srt.layers.linear import QKVParallelLinear

    prefix = f"model.layers.{LAYER}.self_attn."
    torch.set_default_dtype(torch.bfloat16)
    try:
        qkv = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            bias=False,
            quant_config=quant_config,
            prefix=prefix + "qkv_proj",
        )
    finally:
        torch.set_default_dtype(torch.float32)

    def load():
        for shard in ("q", "k", "v"):
            name = f"{prefix}{shard}_proj"
            qkv.weight.weight_loader(qkv.weight, state[name + ".weight"], shard)
            if drop_scale and shard == "k":
                continue
            s = state[name + ".weight_scale_inv"]
            if bad_scale and shard == "v":
                s = s[:, :1]
            qkv.weight_scale_inv.weight_loader(qkv.weight_scale_inv, s, shard)
        qkv.quant_method.process_weights_after_loading(qkv)

    return qkv, _error_of(load)


def main() -> None:
    model, out_path = sys.argv[1], sys.argv[2]
    import json

    from transformers import AutoConfig

    from sglang.srt.layers.moe.expert_cache.method import reset_expert_slot_cache
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.runtime_context import get_exec
    from sglang.test.tiny_models.quantize import block_dequantize_fp8

    cfg = AutoConfig.from_pretrained(model)
    quant = json.loads((Path(model) / "config.json").read_text())["quantization_config"]
    from safetensors.torch import load_file

    state = load_file(str(Path(model) / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(t, cfg.hidden_size, generator=g).bfloat16() for t in CALLS]
    publish_cpu_server(model)
    start_group()
    result = run_configs(
        CONFIGS,
        BANDWIDTHS,
        lambda: _build(cfg, Fp8Config.from_config(quant), state),
        xs,
        lambda cache: _pool_checks(cache, state, cfg.num_experts),
    )
    result["ref"] = _reference(cfg, state, xs)
    result["ref_unscaled"] = _reference(cfg, state, xs, with_scales=False)

    # Broken checkpoints, through the cache's loading.
    errors = {}
    with get_exec().moe.override(enable_expert_cache=True, expert_cache_size="8", **BANDWIDTHS):
        for case, broken in {
            "missing_expert_scale": {k: v for k, v in state.items() if k != BROKEN_EXPERT},
            "misshaped_expert_scale": {**state, BROKEN_EXPERT: state[BROKEN_EXPERT][:, :1]},
        }.items():
            reset_expert_slot_cache()
            errors[case] = _error_of(lambda b=broken: _build(cfg, Fp8Config.from_config(quant), b))
    # Dense FP8 linears (patch 0003): dequantized at load, and their broken scales.
    qkv, err = _qkv_linear_case(cfg, Fp8Config.from_config(quant), state, False, False)
    assert not err, err
    p = f"model.layers.{LAYER}.self_attn."
    want = torch.cat(
        [
            block_dequantize_fp8(
                state[f"{p}{s}_proj.weight"], state[f"{p}{s}_proj.weight_scale_inv"]
            )
            for s in "qkv"
        ]
    )
    result["qkv"] = {
        "method": type(qkv.quant_method).__name__,
        "dtype": str(qkv.weight.dtype),
        "max_abs_err": float((qkv.weight.double() - want).abs().max()),
        "max_abs_ref": float(want.abs().max()),
        "has_scale": hasattr(qkv, "weight_scale_inv"),
    }
    errors["missing_linear_scale"] = _qkv_linear_case(
        cfg, Fp8Config.from_config(quant), state, True, False
    )[1]
    errors["misshaped_linear_scale"] = _qkv_linear_case(
        cfg, Fp8Config.from_config(quant), state, False, True
    )[1]
    result["errors"] = errors
    torch.save(result, out_path)
    print("fp8_moe_block ok", result["method"], errors)


if __name__ == "__main__":
    main()
