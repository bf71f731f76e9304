"""The GPU path's device side, run on the CPU through Triton's interpreter.

On CUDA, ``cuda_branch.CudaForward.forward`` adds two partial sums: the slot experts (hits and
fills) through upstream's Triton ``fused_experts`` over the slot table
(``cuda_branch.slot_experts``), and the remaining misses from the host pool on the CPU
executor. This script runs that same ``slot_experts`` call, unchanged, with
``TRITON_INTERPRET=1`` on CPU tensors, after the control step on random routing, and checks
for every cache size and miss policy that

* the slot partial sum equals a float64 reference over exactly the (token, k) entries that the
  control step sent to slots (so CPU and padding entries, -1 in ``slot_ids``, add nothing);
* slot partial + CPU-executor partial equals the float64 reference of the whole MoE layer;
* ``hidden_states`` is left untouched (the layer's runner config says ``inplace=True``; the
  cache must override it);
* with a routed scaling factor in the runner config (one configuration, 2.5 as GLM-4.5), the
  slot partial is still unscaled (upstream's combine would scale it, the CPU partial not), and
  ``cuda_branch._combine`` scales the sum of both once.

Run by ``test_triton_slot_path.py`` in a fresh process, because ``TRITON_INTERPRET`` must be set
before any Triton kernel is defined; the same test runs :func:`check_config` on a GPU in bf16,
in process, with ``sglang/test/bare_fused_moe.py``'s stand-ins where upstream's CUDA kernel
wheel is missing. Four stand-ins make upstream's CUDA-only plumbing run on
the CPU, each what the CUDA path itself does or an equivalent of it:

* ``moe_align_block_size``'s CUDA op is replaced by upstream's own Triton single-launch align
  (``sglang.kernels.ops.moe.moe_align_small_numel``, through
  ``sglang.test.bare_fused_moe.moe_align_block_size``), which is the op CUDA runs for decode
  batches (at most 64 routed entries) once the slot table has more than 63 slots, and which
  implements the same "+1 offset" contract (a -1 id becomes a block with expert id -1, which
  the fused kernel skips and writes as zeros);
* ``outplace_fused_experts`` is called as its Python body, which is what upstream's custom-op
  wrapper does itself for plain CUDA tensors in eager mode (``_call_directly_in_eager``);
* the device name for the kernel-config lookup is fixed (none of these shapes has a tuned
  config, so the default config is used either way);
* the tensor-parallel group is stated as absent (one device; symmetric memory is off).

Experts are float16 here, not the cache's bfloat16: the interpreter does not compute bfloat16
(``tl.dot`` multiplies the raw bit patterns; triton-lang/triton#11584, and Triton's debugging
guide). The test weights are exact in both formats.

Prints ``triton_slot_path calls=N slot_entries=S cpu_entries=C max_err=E`` and exits 0, or
raises.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _cpu_stand_ins():
    """Install the four stand-ins named in the module docstring; returns the context that
    holds the server state."""
    from sglang.test.bare_fused_moe import moe_align_block_size, server_state

    align = importlib.import_module(
        "sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size"
    )
    align.sgl_moe_align_block_size = moe_align_block_size  # upstream's Triton small-numel align

    fused = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe")
    fused.outplace_fused_experts = fused.outplace_fused_experts.__wrapped__
    config = importlib.import_module(
        "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config"
    )
    config.get_device_name = lambda *_a, **_k: "NVIDIA H200"

    state = server_state("cpu")
    state.__enter__()
    return state


@dataclass
class Totals:
    calls: int = 0
    slot_entries: int = 0
    cpu_entries: int = 0
    max_err: float = 0.0


# Max |error| / max(1, max |reference|): fp16 (interpreter) or bf16 (CUDA) experts and
# activations, fp32 accumulation, one rounding of the intermediate and of the output.
TOL = 2e-2
# (size, policy[, routed scaling factor]): the last one as GLM-4.5 scales its routed experts.
CONFIGS = [
    ("100%", "fill"),
    ("4", "qstar"),
    ("25%", "qstar"),
    ("25%", "cpu"),
    ("50%", "fill", 2.5),
]


def check_config(
    size: str,
    policy: str,
    totals: Totals,
    factor: float | None = None,
    device: str = "cpu",
    dtype=torch.float16,
) -> None:
    """One cache configuration on ``device`` with ``dtype`` slots and activations (the
    interpreter: cpu / float16; a GPU: cuda / bfloat16, the cache's own format), with
    ``factor`` as the runner config's routed scaling factor."""
    from dataclasses import replace

    import test_slot_cache
    from test_slot_cache import H, make_cache, reference, routing

    import sgl_kernel_fork  # noqa: F401  (torch.ops.sgl_kernel.*)
    from sglang.srt.layers.moe.expert_cache.cuda_branch import _combine, slot_experts

    cache = make_cache(size, policy, device=device)
    runner_config = replace(test_slot_cache.runner_config(), routed_scaling_factor=factor)
    for layer, x, w, ids in routing(steps=6, seed=3):
        routing_ = cache.route(layer, ids.to(device).contiguous())
        slot_ids, cpu_ids = routing_.slot_ids, routing_.cpu_ids.cpu()
        x_dev = x.to(device, dtype)
        x_before = x_dev.clone()
        slots = {n: cache.slots[n].to(dtype) for n in ("w13", "w2")}
        slot_part = slot_experts(slots, x_dev, w.to(device), slot_ids, runner_config)
        assert torch.equal(x_dev, x_before), "the slot experts wrote into hidden_states"
        assert slot_part.shape == (x.shape[0], H) and slot_part.dtype == dtype
        slot_part = slot_part.cpu()
        cpu_part = torch.empty(x.shape[0], H, dtype=torch.float32)
        torch.ops.sgl_kernel.moe_experts_cpu(
            x, w, [cpu_ids], [cache.host["w13"]], [cache.host["w2"]], cpu_part, False
        )
        on_slot = slot_ids.cpu() >= 0
        ref_slot = reference(cache, layer, x, w.masked_fill(~on_slot, 0.0), ids)
        ref_all = reference(cache, layer, x, w, ids)
        scale = max(1.0, float(ref_all.abs().max()))
        err_slot = float((slot_part.double() - ref_slot).abs().max()) / scale
        err_all = float((slot_part.double() + cpu_part.double() - ref_all).abs().max()) / scale
        # a change of MoE kernel and of rounding, not an error
        assert err_slot <= TOL, f"{size}/{policy} layer {layer}: slot part off by {err_slot}"
        assert err_all <= TOL, f"{size}/{policy} layer {layer}: sum off by {err_all}"
        if factor is not None:
            combined = _combine(slot_part, cpu_part, factor, dtype)
            err_scaled = float((combined.double() - factor * ref_all).abs().max()) / (
                factor * scale
            )
            assert err_scaled <= TOL, f"{size}/{policy} layer {layer}: scaled sum {err_scaled}"
        totals.calls += 1
        totals.slot_entries += int(on_slot.sum())
        totals.cpu_entries += int((cpu_ids >= 0).sum())
        totals.max_err = max(totals.max_err, err_slot, err_all)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (see the module docstring)")
    _state = _cpu_stand_ins()
    totals = Totals()
    for size, policy, *factor in CONFIGS:
        check_config(size, policy, totals, *factor)
    assert totals.slot_entries > 0 and totals.cpu_entries > 0
    print(
        f"triton_slot_path calls={totals.calls} slot_entries={totals.slot_entries} "
        f"cpu_entries={totals.cpu_entries} max_err={totals.max_err:.2e}"
    )


if __name__ == "__main__":
    main()
