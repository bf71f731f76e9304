"""Shared by the layer-level MoE block checks (``*_block_check.py``, each run in a fresh
process): SGLang's runtime context for a CPU server, a one-process gloo group, and the weight
loading of a block from a checkpoint's state dict through upstream's weight loaders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def publish_cpu_server(model: str) -> None:
    """SGLang's runtime context for a CPU server of ``model`` (no expert cache)."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(
        ServerArgs(model_path=model, device="cpu", tp_size=1),
        role="test",
        ranks=SpawnRanks(world_rank=0),
    )


def start_group() -> None:
    """A world of one process (gloo), and upstream's model-parallel groups over it (the
    packer's own helper, ``pack.start_single_process_group``)."""
    from sglang.srt.layers.moe.expert_cache.pack import start_single_process_group

    start_single_process_group()


def load_block(block, state: dict, prefix: str, num_experts: int) -> None:
    """Feed the checkpoint tensors under ``prefix`` to the block's parameters the way the
    models' ``load_weights`` do (expert and stacked mappings, weight loaders): bf16 or FP8
    (``*.weight_scale_inv`` map to the ``w13_`` / ``w2_`` scale parameters likewise).

    Raises:
        AssertionError: a tensor without a mapping, or parameters the state did not fill.
    """
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    params = dict(block.named_parameters())
    experts = FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj",
        ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj",
        num_experts=num_experts,
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


def run_block_check(script: Path, model: Path, out: Path, env: dict | None = None):
    """Run a ``*_block_check.py`` ``script`` on ``model`` in a fresh process (CPU engine, no
    Hub) and return what it saved to ``out`` (``torch.load``).

    Raises:
        AssertionError: the script failed; the message carries the end of its output.
    """
    import torch

    env = dict(os.environ, HF_HUB_OFFLINE="1", SGLANG_USE_CPU_ENGINE="1", **(env or {}))
    proc = subprocess.run(
        [sys.executable, str(script), str(model), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)


def run_configs(configs: dict, bandwidths: dict, build, xs: list, pool_checks) -> dict:
    """Build the block once per configuration and run it on every input.

    ``configs``: {name: expert-cache flags of ``ExecMoe`` (empty: no cache, upstream's path)};
    ``bandwidths``: the fixed B_P / B_H flags every cache configuration gets; ``build()``: the
    block under the current flags; ``xs``: inputs [T, hidden] bf16; ``pool_checks(cache)``: the
    format's checks of the host pool and slots.

    Returns:
        ``{"method": {name: quant method class name}, name: [output [T, hidden] per input],
        "pool": {name: pool_checks(cache)}, "snapshot": {name: cache.snapshot() plus
        ``streamed_passes``, the prefill double buffer's passes}}``, pool and snapshot for the
        cache configurations only.
    """
    import torch

    from sglang.srt.layers.moe.expert_cache.method import reset_expert_slot_cache
    from sglang.srt.runtime_context import get_exec

    result = {"method": {}, "pool": {}, "snapshot": {}}
    for name, flags in configs.items():
        reset_expert_slot_cache()
        cache_flags = dict(enable_expert_cache=True, **flags, **bandwidths) if flags else {}
        with get_exec().moe.override(**cache_flags):
            block = build()
            method = block.experts.quant_method
            result["method"][name] = type(method).__name__
            with torch.no_grad():
                result[name] = [block.forward_normal(x) for x in xs]
            if flags:
                result["pool"][name] = pool_checks(method.cache)
                snapshot = method.cache.snapshot()
                snapshot["streamed_passes"] = sum(method.cache.prefill_stream.passes.values())
                result["snapshot"][name] = snapshot
    return result
