"""ModelOpt MIXED_PRECISION on the CPU (patches 0081, 0082; nvidia/Qwen3.6-35B-A3B-NVFP4):
per-tensor FP8 linears dequantized at load (``nvfp4_cpu.dequantize_fp8_linear``), unloaded
scales named, and a checkpoint's FP8 KV-cache declaration keeping the model dtype on a CPU
without AMX. The served model: ``test/e2e/test_expert_cache_nvfp4.py``."""

from types import SimpleNamespace

import pytest
import torch


def _fp8_layer(widths, scales, k=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(sum(widths), k, generator=g) * 8).to(torch.float8_e4m3fn)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.tensor(scales), requires_grad=False)
    layer.input_scale = torch.nn.Parameter(torch.tensor([1.0] * len(widths)), requires_grad=False)
    layer.logical_widths = list(widths)
    layer.orig_dtype = torch.bfloat16
    layer.prefix = "model.language_model.layers.3.self_attn.qkv_proj"
    return layer, w


def test_fp8_linear_dequantized_per_shard():
    from sglang.srt.layers.quantization.nvfp4_cpu import dequantize_fp8_linear
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    widths, scales = [16, 8, 8], [0.5, 0.25, 2.0]
    layer, w = _fp8_layer(widths, scales)
    dequantize_fp8_linear(layer)
    row = torch.tensor(scales).repeat_interleave(torch.tensor(widths))
    want = (w.double() * row.double()[:, None]).to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight.data, want)
    assert not hasattr(layer, "weight_scale") and not hasattr(layer, "input_scale")
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)


def test_fp8_linear_unloaded_scale_named():
    from sglang.srt.layers.quantization.nvfp4_cpu import dequantize_fp8_linear

    unloaded = torch.finfo(torch.float32).min  # upstream's fill value until loaded
    layer, _ = _fp8_layer([16, 8, 8], [0.5, unloaded, 2.0])
    with pytest.raises(ValueError, match=r"layers\.3\.self_attn\.qkv_proj\.weight_scale.*\[1\]"):
        dequantize_fp8_linear(layer)


def test_checkpoint_fp8_kv_keeps_model_dtype_without_amx(monkeypatch):
    import sglang.srt.mem_cache.kv_cache_dtype as kv_mod
    import sglang.srt.platforms as platforms
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
    from sglang.srt.utils import cpu_has_amx_support

    if cpu_has_amx_support():
        pytest.skip("this CPU has AMX: upstream's CPU FP8 KV cache applies")
    # the server's platform (--device cpu); a pytest process does not detect one
    cpu = SimpleNamespace(is_cpu=lambda: True)
    monkeypatch.setattr(kv_mod, "current_platform", cpu)
    monkeypatch.setattr(platforms, "current_platform", cpu, raising=False)
    model = SimpleNamespace(quant_config=SimpleNamespace(kv_cache_quant_algo="FP8"))
    common = dict(
        model=model,
        model_dtype=torch.bfloat16,
        is_draft_worker=False,
        is_dflash=False,
        speculative_draft_attention_backend=None,
    )
    _, dtype = configure_kv_cache_dtype(server_args_kv_cache_dtype="auto", **common)
    assert dtype == torch.bfloat16
    # an explicit request is left to upstream
    _, dtype = configure_kv_cache_dtype(server_args_kv_cache_dtype="fp8_e4m3", **common)
    assert dtype == torch.float8_e4m3fn
    # not a CPU: upstream's resolution
    monkeypatch.setattr(kv_mod, "current_platform", SimpleNamespace(is_cpu=lambda: False))
    _, dtype = configure_kv_cache_dtype(server_args_kv_cache_dtype="auto", **common)
    assert dtype == torch.float8_e4m3fn
