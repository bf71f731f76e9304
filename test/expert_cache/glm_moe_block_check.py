"""One GLM-4.5 MoE block (upstream's ``Glm4MoeSparseMoeBlock``) built three ways on the CPU.

Run by ``test_glm_moe_layer.py`` in a fresh process (it publishes SGLang's runtime context and
starts a one-process gloo group, which must not leak into other tests). Arguments: the tiny
``glm4_moe`` model folder (``sglang.test.tiny_models``; ``make_for_layer`` reads its config
through the runtime context) and an output file.

The block of layer 1 (layer 0 is dense: ``first_k_dense_replace = 1``) is built by upstream's
own class, from transformers' ``Glm4MoeConfig`` of the model, with upstream's weight loaders
fed the checkpoint's tensors, in each configuration:

* ``stock``: no expert cache (``UnquantizedFusedMoEMethod.forward_cpu``: on this CPU our
  executor, patch 0032);
* ``resident``: ``--enable-expert-cache --expert-cache-size 100% --expert-cache-policy fill``;
* ``slots8``: ``--expert-cache-size 8 --expert-cache-policy qstar`` (one layer's top-k), so
  calls have hits, fills and CPU experts;

both with B_P / B_H fixed at 0.5 (``--expert-cache-fill-gbps 10 --expert-cache-cpu-gbps 20``).

Each runs ``forward_normal`` (upstream's: gate -> ``TopK`` -> ``FusedMoE`` -> ``*=
routed_scaling_factor`` on the CPU -> + shared expert) on the same ``CALLS`` batches. The
reference is transformers' ``Glm4MoeMoE`` (router, experts, shared expert; float32) with the
same tensors, and the same module with ``routed_scaling_factor = 1`` (``hf_unscaled``: what a
dropped factor would give; a doubled one is as far off on the other side). Also recorded: upstream's ``TopK`` ids and weights against transformers' router.

Dynamo is off (``TORCHDYNAMO_DISABLE=1``, set by the test): upstream wraps the biased grouped
top-k in ``torch.compile``, whose first compilation costs more than the whole check on a small
CPU; the eager function is the same routing. The server (test/e2e/test_expert_cache_glm.py)
runs it compiled.

Writes ``{config: [output [T, H] bf16 per call]}``, ``hf`` and ``hf_unscaled`` (float32
outputs), ``topk``
(upstream ids [T, K] int32, weights [T, K] float32) and ``hf_topk`` (ids, weights), the shared-
expert resolution and the method class of each configuration, with ``torch.save``.
"""

from __future__ import annotations

import sys

import torch

CALLS = (1, 3, 37, 2, 64)  # tokens per call: decode-like and prefill-like batches
LAYER = 1
CONFIGS = {
    "stock": {},
    "resident": dict(
        enable_expert_cache=True, expert_cache_size="100%", expert_cache_policy="fill"
    ),
    "slots8": dict(enable_expert_cache=True, expert_cache_size="8", expert_cache_policy="qstar"),
}
# B_P / B_H fixed (0.5: qstar fills half the misses), so nothing is measured or cached.
BANDWIDTHS = dict(expert_cache_fill_gbps=10.0, expert_cache_cpu_gbps=20.0)


def _publish(model: str) -> None:
    """SGLang's runtime context for a CPU server of ``model`` (no expert cache)."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(
        ServerArgs(model_path=model, device="cpu", tp_size=1),
        role="test",
        ranks=SpawnRanks(world_rank=0),
    )


def _load(block, state: dict, prefix: str) -> None:
    """Feed the checkpoint tensors under ``prefix`` to the block's parameters the way
    ``Glm4MoeForCausalLM.load_weights`` does (expert and stacked mappings, weight loaders)."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    params = dict(block.named_parameters())
    experts = FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj",
        ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj",
        num_experts=block.config.n_routed_experts,
    )
    stacked = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    loaded = set()
    for full, w in state.items():
        if not full.startswith(prefix):
            continue
        name = full[len(prefix) :]
        if name.startswith("experts."):
            for param_name, weight_name, expert_id, shard_id in experts:
                if weight_name in name:
                    target = name.replace(weight_name, param_name)
                    p = params[target]
                    p.weight_loader(p, w, target, shard_id=shard_id, expert_id=expert_id)
                    break
            else:
                raise AssertionError(f"no expert mapping for {full}")
        else:
            for param_name, weight_name, shard_id in stacked:
                if weight_name in name:
                    target = name.replace(weight_name, param_name)
                    params[target].weight_loader(params[target], w, shard_id)
                    break
            else:
                target = name
                p = params[target]
                getattr(p, "weight_loader", default_weight_loader)(p, w)
        loaded.add(target)
    missing = set(params) - loaded
    assert not missing, f"parameters the checkpoint did not fill: {sorted(missing)}"


def _build(cfg, state: dict):
    from sglang.srt.layers.moe.utils import resolve_shared_experts_config
    from sglang.srt.models.glm4_moe import Glm4MoeForCausalLM, Glm4MoeSparseMoeBlock
    from sglang.srt.runtime_context import get_model

    shared = resolve_shared_experts_config(Glm4MoeForCausalLM, cfg, None)
    torch.set_default_dtype(torch.bfloat16)  # what the model loader sets for a bf16 model
    try:
        with get_model().override(shared_experts=shared):
            block = Glm4MoeSparseMoeBlock(cfg, layer_id=LAYER, prefix=f"model.layers.{LAYER}.mlp")
    finally:
        torch.set_default_dtype(torch.float32)
    _load(block, state, f"model.layers.{LAYER}.mlp.")
    block.experts.quant_method.process_weights_after_loading(block.experts)
    return block, shared


def _inputs(hidden: int) -> list:
    """One [T, hidden] bf16 batch per entry of ``CALLS`` (unit-rms, as after an RMSNorm)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randn(t, hidden, generator=g).bfloat16() for t in CALLS]


def _hf_block(cfg, state: dict):
    """transformers' ``Glm4MoeMoE`` in float32 with the checkpoint's tensors (its experts are
    fused: ``gate_up_proj[e] = cat(gate_proj, up_proj)``)."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    p = f"model.layers.{LAYER}.mlp."
    moe = Glm4MoeMoE(cfg).float().eval()
    E = cfg.n_routed_experts
    with torch.no_grad():
        moe.gate.weight.copy_(state[p + "gate.weight"].float())
        moe.gate.e_score_correction_bias.copy_(state[p + "gate.e_score_correction_bias"].float())
        for e in range(E):
            x = f"{p}experts.{e}."
            moe.experts.gate_up_proj[e].copy_(
                torch.cat([state[x + "gate_proj.weight"], state[x + "up_proj.weight"]]).float()
            )
            moe.experts.down_proj[e].copy_(state[x + "down_proj.weight"].float())
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(moe.shared_experts, n).weight.copy_(
                state[f"{p}shared_experts.{n}.weight"].float()
            )
    return moe


def main() -> None:
    model, out_path = sys.argv[1], sys.argv[2]
    from transformers import AutoConfig

    from sglang.srt.layers.moe.expert_cache.method import reset_expert_slot_cache
    from sglang.srt.runtime_context import get_exec
    from sglang.test.tiny_models import builder

    cfg = AutoConfig.from_pretrained(model)
    state = builder.make_state_dict("glm4_moe")
    xs = _inputs(cfg.hidden_size)
    result = {"shared": {}, "method": {}}
    _publish(model)
    from sglang.srt.layers.moe.expert_cache.pack import start_single_process_group

    start_single_process_group()
    for name, flags in CONFIGS.items():
        reset_expert_slot_cache()
        # The server flags of this configuration (as `--enable-expert-cache ...` would set
        # them); the groups built above stay.
        with get_exec().moe.override(**flags, **(BANDWIDTHS if flags else {})):
            block, shared = _build(cfg, state)
            result["shared"][name] = (shared.fusion_disabled, shared.num_fused_shared_experts)
            result["method"][name] = type(block.experts.quant_method).__name__
            with torch.no_grad():
                result[name] = [block.forward_normal(x) for x in xs]
                if name == "stock":
                    topk = [block.topk(x, block.gate(x)) for x in xs]
                    result["topk"] = [(t.topk_ids.clone(), t.topk_weights.clone()) for t in topk]
            if name != "stock":
                result.setdefault("snapshot", {})[name] = (
                    block.experts.quant_method.cache.snapshot()
                )
    hf = _hf_block(cfg, state)
    with torch.no_grad():
        result["hf"] = [hf(x.float()) for x in xs]
        gates = [hf.gate(x.float()) for x in xs]  # (router_logits, weights, indices)
        result["hf_topk"] = [(ids, w) for _, w, ids in gates]
        hf.gate.routed_scaling_factor = 1.0
        result["hf_unscaled"] = [hf(x.float()) for x in xs]
    torch.save(result, out_path)
    print("glm_moe_block ok", {k: result["method"][k] for k in CONFIGS})


if __name__ == "__main__":
    main()
