"""Pinning overlapped with a pack's reads, on CUDA (``pack_io.read_pack(pin=...)`` with
``ExpertBanks.pin_bank``; the ordering itself is tested on the CPU in ``test_pack.py``).

Skipped without a GPU; run by ``scripts/gpu_checks.sh``. A pool packed and read back with
``pin=banks.pin_bank``: every bank is reported pinned, the later ``ExpertBanks.pin`` of the
cache's ``finalize`` keeps them (a second ``cudaHostRegister`` of the same memory would fail),
the driver really holds them registered (``cudaHostUnregister`` succeeds once per bank), and
a non-blocking copy of the pinned rows to the GPU is bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.moe.expert_cache import pack_format as fmt
from sglang.srt.layers.moe.expert_cache import pack_io
from sglang.srt.layers.moe.expert_cache.banks import BF16, ExpertBanks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA)")

L, E, H, I = 2, 8, 256, 128


def test_banks_pinned_while_reading_stay_pinned(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    save_file({"a": torch.zeros(4)}, str(d / "model.safetensors"))
    src = ExpertBanks(BF16, H, I, L * E, "cpu")
    for t in src.tensors.values():
        t.copy_(torch.randn(t.shape).to(t.dtype))
    path = tmp_path / "p.pack"
    pack_io.write_pack(path, src, E, list(range(L)), fmt.model_identity(d), progress=False)
    header = fmt.read_header(path)
    dst = ExpertBanks(BF16, H, I, L * E, "cpu")
    stats = pack_io.read_pack(path, dst, header["chunks"], progress=False, pin=dst.pin_bank)
    assert sorted(stats.pinned) == sorted(dst.tensors)
    assert dst.pin()  # keeps the banks pinned while reading: no second registration
    assert all(t.is_pinned() for t in dst.tensors.values())  # what the bank copy checks
    for name, t in dst.tensors.items():
        gpu = t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(gpu.cpu().view(torch.uint8), src[name].view(torch.uint8)), name
    cudart = torch.cuda.cudart()
    for name in dst.tensors:
        base = dst[name].untyped_storage().data_ptr()  # registered from the storage's base
        assert int(cudart.cudaHostUnregister(base)) == 0, name
    dst._pinned_banks.clear()
    dst._registered = False
