"""A gpt-oss MoE block (upstream's ``GptOssSparseMoeBlock``, ``Mxfp4MoEMethod`` experts) built
several ways on the CPU, with upstream's ``Mxfp4Config`` read from the tiny gpt-oss checkpoint's
``quantization_config``.

Run by ``test_gpt_oss_moe_layer.py`` in a fresh process (runtime context, gloo group).
Arguments: the tiny ``gpt_oss`` model folder (``sglang.test.tiny_models --arch gpt_oss``: the
MXFP4 layout of openai/gpt-oss-20b) and an output file. The block of layer ``LAYER`` is loaded
through upstream's own MXFP4 expert loader (``GptOssForCausalLM._load_mxfp4_experts_weights``,
whole-layer tensors with ``expert_id=None``) in each configuration of :data:`CONFIGS`
(``stock``: ``Mxfp4MoEMethod`` without the cache, on this CPU dequantized at load and run by
upstream's ``moe_forward_native`` (patch 0011); the others ``--enable-expert-cache`` at several
sizes and policies) and runs ``forward_normal`` on the batches of :data:`CALLS`, scaled so that
gpt-oss's clamps at 7 are hit.

Recorded per cache configuration: the outputs, the counters, the host pool's banks, whether
every host-pool row of the layer holds the checkpoint's bytes de-interleaved (gate rows then up
rows of the packed e2m1 codes, the e8m0 scales and the gate/up bias; down as released) and
whether every slot holds the bytes of the host row it caches. Recorded once: the float64
reference (transformers' ``GptOssMLP`` as ``quantize_mxfp4.gpt_oss_experts_reference`` computes
it, on the routing the block picked), the same without the clamp and without biases, and the
errors of broken checkpoints through the cache (scales missing, a mis-shaped bias).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from moe_block_util import publish_cpu_server, run_configs, start_group  # noqa: E402

CALLS = (1, 3, 37, 2, 64)
X_SCALE = 8.0  # inputs x 8: the clamps at 7 are hit (test_epilogue.py's choice)
LAYER = 1
BANDWIDTHS = dict(expert_cache_fill_gbps=10.0, expert_cache_cpu_gbps=20.0)  # q*/m = 0.5
CONFIGS = {
    "stock": {},
    "resident": dict(expert_cache_size="100%", expert_cache_policy="fill"),
    "slots8_qstar": dict(expert_cache_size="8", expert_cache_policy="qstar"),
    "slots4_cpu": dict(expert_cache_size="4", expert_cache_policy="cpu"),
    "slots50pct_fill": dict(expert_cache_size="50%", expert_cache_policy="fill"),
    # the prefill double buffer: passes of more than one token stream the layer into slots
    "stream_forced": dict(expert_cache_size="100%", expert_cache_prefill_stream="force"),
}
PREFIX = f"model.layers.{LAYER}.mlp."
EXPERTS = PREFIX + "experts."


class _Root(torch.nn.Module):
    """The block at ``model.layers.{LAYER}.mlp`` of a module with the model's ``config``: what
    ``GptOssForCausalLM._load_mxfp4_experts_weights`` reads (``named_parameters``,
    ``get_submodule``, ``config``)."""

    def __init__(self, block, config):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleDict({str(LAYER): torch.nn.Module()})
        self.model.layers[str(LAYER)].mlp = block
        self.config = config


def _build(cfg, quant_config, state: dict):
    from sglang.srt.models.gpt_oss import GptOssForCausalLM, GptOssSparseMoeBlock

    torch.set_default_dtype(torch.bfloat16)
    try:
        block = GptOssSparseMoeBlock(
            layer_id=LAYER, config=cfg, quant_config=quant_config, prefix=PREFIX.rstrip(".")
        )
    finally:
        torch.set_default_dtype(torch.float32)
    root = _Root(block, cfg)
    experts = [(k, v) for k, v in state.items() if k.startswith(EXPERTS)]
    GptOssForCausalLM._load_mxfp4_experts_weights(root, experts)
    for name in ("weight", "bias"):
        getattr(block.router, name).data.copy_(state[f"{PREFIX}router.{name}"])
    block.experts.quant_method.process_weights_after_loading(block.experts)
    return block


def _checkpoint_rows(state: dict) -> dict:
    """The layer's checkpoint tensors in the bank layout: w13 tensors de-interleaved."""
    from sglang.srt.layers.moe.expert_cache.formats import deinterleave_gate_up

    return {
        "w13": deinterleave_gate_up(state[EXPERTS + "gate_up_proj_blocks"].flatten(2)),
        "w2": state[EXPERTS + "down_proj_blocks"].flatten(2),
        "w13_scale": deinterleave_gate_up(state[EXPERTS + "gate_up_proj_scales"]),
        "w2_scale": state[EXPERTS + "down_proj_scales"],
        "w13_bias": deinterleave_gate_up(state[EXPERTS + "gate_up_proj_bias"].bfloat16()),
        "w2_bias": state[EXPERTS + "down_proj_bias"].bfloat16(),
    }


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _pool_checks(cache, state: dict, num_experts: int) -> dict:
    rows = slice(LAYER * num_experts, (LAYER + 1) * num_experts)
    host_ok = all(
        _same_bytes(cache.host[name][rows], want.contiguous())
        for name, want in _checkpoint_rows(state).items()
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
        "activation": cache.activation,
    }


def _routing(cfg, state: dict, x: torch.Tensor):
    """The block's routing of ``x``, from the router logits as the block computes them (a bf16
    linear: the router is not what is checked, and at inputs x 8 its bf16 logits move the
    weights by ~1e-2): top-k, softmax over the k in float64."""
    w = state[PREFIX + "router.weight"]
    logits = torch.nn.functional.linear(x, w, state[PREFIX + "router.bias"]).double()
    val, idx = logits.topk(cfg.num_experts_per_tok, dim=-1)
    return idx, torch.softmax(val, dim=-1)


def _references(cfg, state: dict, xs) -> dict:
    from sglang.test.tiny_models.quantize_mxfp4 import gpt_oss_experts_reference

    nobias = {
        **state,
        EXPERTS + "gate_up_proj_bias": torch.zeros_like(state[EXPERTS + "gate_up_proj_bias"]),
        EXPERTS + "down_proj_bias": torch.zeros_like(state[EXPERTS + "down_proj_bias"]),
    }
    out = {"ref": [], "ref_unclamped": [], "ref_nobias": []}
    for x in xs:
        idx, w = _routing(cfg, state, x)
        out["ref"].append(gpt_oss_experts_reference(x, state, PREFIX, idx, w))
        out["ref_unclamped"].append(gpt_oss_experts_reference(x, state, PREFIX, idx, w, 1e9))
        out["ref_nobias"].append(gpt_oss_experts_reference(x, nobias, PREFIX, idx, w))
    return out


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return ""


def main() -> None:
    model, out_path = sys.argv[1], sys.argv[2]
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from sglang.srt.layers.moe.expert_cache.method import reset_expert_slot_cache
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config
    from sglang.srt.runtime_context import get_exec

    cfg = AutoConfig.from_pretrained(model)
    state = {}
    for f in sorted(Path(model).glob("*.safetensors")):
        state.update(load_file(str(f)))
    g = torch.Generator().manual_seed(7)
    xs = [(torch.randn(t, cfg.hidden_size, generator=g) * X_SCALE).bfloat16() for t in CALLS]
    publish_cpu_server(model)
    start_group()
    quant = cfg.quantization_config
    result = run_configs(
        CONFIGS,
        BANDWIDTHS,
        lambda: _build(cfg, Mxfp4Config.from_config(quant), state),
        xs,
        lambda cache: _pool_checks(cache, state, cfg.num_local_experts),
    )
    result.update(_references(cfg, state, xs))

    errors = {}
    broken_states = {
        "missing_scales": {k: v for k, v in state.items() if "gate_up_proj_scales" not in k},
        "misshaped_bias": {
            **state,
            EXPERTS + "down_proj_bias": state[EXPERTS + "down_proj_bias"][:, :-1].contiguous(),
        },
    }
    flags = dict(enable_expert_cache=True, expert_cache_size="8", **BANDWIDTHS)
    with get_exec().moe.override(**flags):
        for case, broken in broken_states.items():
            reset_expert_slot_cache()
            errors[case] = _error_of(
                lambda b=broken: _build(cfg, Mxfp4Config.from_config(quant), b)
            )
    result["errors"] = errors
    torch.save(result, out_path)
    print("gpt_oss_moe_block ok", result["method"], errors)


if __name__ == "__main__":
    main()
