"""The packed expert pool (``expert_cache/pack*.py``): format, reader, refusals, atomicity.

Format level (in this process): a pool written and read back is bit-identical, through
``O_DIRECT`` and through buffered reads, for a three-bank format as for bf16 (bank-generic),
and with rows whose slabs do not end on a 4096-byte boundary; a truncated, bit-flipped (data
or header), other-version or stale (config or weight file changed) pack is refused with a
message that says what is wrong; a packer killed with SIGKILL at random points never leaves a
file the server would load.

Model level (``pack_pool_check.py``, a fresh process per model): the tiny ``qwen3_moe`` model packed by
the packer, then loaded as a server loads it, from the pack (logged, the experts' checkpoint
tensors skipped) and, after a bit flip in the pack's data, from the checkpoint (refusal
logged): every bank row and every other parameter is bit-identical to the checkpoint load;
the same (pack against checkpoint) for its block-FP8 build, FP8 and scale banks included.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from sglang.srt.layers.moe.expert_cache import pack_format as fmt
from sglang.srt.layers.moe.expert_cache import pack_io
from sglang.srt.layers.moe.expert_cache.banks import BF16, BankSpec, ExpertBanks, ExpertFormat

SCRIPT = Path(__file__).with_name("pack_pool_check.py")
L, E = 3, 8  # layers, experts per layer
MOE_LAYERS = [1, 2]  # layer 0 dense: its rows are not packed


@dataclass(frozen=True)
class ScaledFormat(ExpertFormat):
    """A stand-in for a quantized format: bf16 weights plus a per-row float32 scale bank
    whose slabs are not multiples of 4096 bytes."""

    def banks(self, hidden_size, intermediate_size):
        return super().banks(hidden_size, intermediate_size) + (
            BankSpec("w13_scale", "w13_weight_scale", (2 * intermediate_size, 3), torch.float32),
        )


def _pool(fmt_=BF16, h=64, i=32, seed=0) -> ExpertBanks:
    g = torch.Generator().manual_seed(seed)
    b = ExpertBanks(fmt_, h, i, L * E, "cpu")
    for t in b.tensors.values():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return b


def _model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "x"}')
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(4)}, str(d / "model.safetensors"))
    return d


def _write(tmp_path, pool, name="p.pack"):
    d = tmp_path / "model" if (tmp_path / "model").exists() else _model_dir(tmp_path)
    path = tmp_path / name
    pack_io.write_pack(path, pool, E, MOE_LAYERS, fmt.model_identity(d), progress=False)
    return path, d


def _moe_rows(pool, name):
    return torch.cat([pool[name][l * E : (l + 1) * E] for l in MOE_LAYERS])


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("fmt_", [BF16, ScaledFormat("scaled", torch.bfloat16)])
def test_round_trip_bit_identical(tmp_path, monkeypatch, direct, fmt_):
    monkeypatch.setattr(fmt, "CHUNK_BYTES", 3 * 4096)  # several chunks per slab
    src = _pool(fmt_)
    path, d = _write(tmp_path, src)
    header = fmt.read_header(path)
    pool = fmt.pool_description(src, E, MOE_LAYERS)
    assert fmt.check_header(header, fmt.model_identity(d), pool) == []
    assert [b["name"] for b in header["pool"]["banks"]] == [s.name for s in src.specs]
    dst = ExpertBanks(fmt_, 64, 32, L * E, "cpu")
    for t in dst.tensors.values():
        assert t.data_ptr() % 4096 == 0
        t.view(torch.uint8).fill_(0xAB)
    stats = pack_io.read_pack(path, dst, header["chunks"], threads=3, direct=direct, progress=False)
    for s in src.specs:
        assert torch.equal(
            _moe_rows(dst, s.name).view(torch.uint8), _moe_rows(src, s.name).view(torch.uint8)
        )
        assert (dst[s.name][:E].view(torch.uint8) == 0xAB).all()  # the dense layer untouched
    assert stats.nbytes == sum(c.nbytes for c in header["chunks"])
    if not direct:
        assert stats.direct_bytes == 0
    elif pack_io._open_direct(path) is not None:  # the file system takes O_DIRECT
        assert stats.direct_bytes > 0
    for c in header["chunks"]:
        assert c.offset % fmt.ALIGN == 0


def _refusal(path, pool, d) -> str:
    try:
        header = fmt.read_header(path)
        problems = fmt.check_header(
            header, fmt.model_identity(d), fmt.pool_description(pool, E, MOE_LAYERS)
        )
        if problems:
            return "; ".join(problems)
        dst = ExpertBanks(pool.format, pool.hidden_size, pool.intermediate_size, pool.rows, "cpu")
        pack_io.read_pack(path, dst, header["chunks"], progress=False)
    except fmt.PackRefused as e:
        return str(e)
    return ""


def test_bad_packs_are_refused(tmp_path):
    src = _pool()
    path, d = _write(tmp_path, src)
    assert _refusal(path, src, d) == ""
    raw = path.read_bytes()

    def variant(data: bytes) -> str:
        path.write_bytes(data)
        return _refusal(path, src, d)

    assert "truncated" in variant(raw[: len(raw) - 4096])
    assert "truncated" in variant(raw[:20])
    flip = bytearray(raw)
    flip[-100] ^= 0x01  # one bit of the last chunk's data
    assert "fails its checksum" in variant(bytes(flip))
    flip = bytearray(raw)
    flip[fmt.PREFIX.size + 10] ^= 0x20  # one bit of the header
    assert "header is truncated or corrupt" in variant(bytes(flip))
    other = bytearray(raw)
    other[16:20] = struct.pack("<I", fmt.VERSION + 1)
    assert f"pack version {fmt.VERSION + 1}" in variant(bytes(other))
    assert "not an expert-pool pack" in variant(b"\0" * len(raw))
    path.write_bytes(raw)
    # stale: the model changed after packing
    (d / "config.json").write_text('{"model_type": "y"}')
    assert "config.json changed" in _refusal(path, src, d)
    (d / "config.json").write_text('{"model_type": "x"}')
    os.utime(d / "model.safetensors", ns=(1, 1))
    assert "model.safetensors changed since the pack was made (mtime_ns" in _refusal(path, src, d)
    # another pool shape (e.g. --dtype float16, or another expert format)
    msg = _refusal(path, _pool(BF16, h=32), d)
    assert "pool hidden_size is 64 in the pack, the server needs 32" in msg


def test_same_size_same_mtime_rewrite_is_refused(tmp_path):
    """A weight file rewritten in place (same bytes count, same safetensors header) with its
    mtime restored: only the status-change time tells, and the pack is refused."""
    from safetensors.torch import save_file

    src = _pool()
    path, d = _write(tmp_path, src)
    w = d / "model.safetensors"
    st = w.stat()
    time.sleep(0.01)  # a later ctime even on a coarse clock
    save_file({"a": torch.ones(4)}, str(w))  # other data, same header and size
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert w.stat().st_size == st.st_size and w.stat().st_mtime_ns == st.st_mtime_ns
    msg = _refusal(path, src, d)
    assert "model.safetensors changed since the pack was made (ctime_ns)" in msg


def test_banks_pinned_as_filled_while_others_read(tmp_path, monkeypatch):
    """``read_pack(pin=...)``: each bank is pinned once, after every chunk of it is read and
    verified, and before the last bank's reads finish (one reader thread, banks read in
    order: the w2 reads wait until w13 is pinned, which a pin after the last read would not
    do); nothing is pinned after a failed chunk."""
    import threading

    monkeypatch.setattr(fmt, "CHUNK_BYTES", 3 * 4096)
    src = _pool()
    path, d = _write(tmp_path, src)
    header = fmt.read_header(path)
    dst = ExpertBanks(BF16, 64, 32, L * E, "cpu")
    w13_pinned = threading.Event()
    calls, waited = [], []
    real_read = pack_io._read_into

    def read_into(fd, mv, offset):
        if offset >= min(c.offset for c in header["chunks"] if c.bank == "w2"):
            waited.append(w13_pinned.wait(timeout=20))
        real_read(fd, mv, offset)

    def pin(name):
        calls.append((name, torch.equal(_moe_rows(dst, name), _moe_rows(src, name))))
        if name == "w13":
            w13_pinned.set()
        return name == "w13"  # w2: "the driver refused"

    monkeypatch.setattr(pack_io, "_read_into", read_into)
    stats = pack_io.read_pack(path, dst, header["chunks"], threads=1, progress=False, pin=pin)
    assert calls == [("w13", True), ("w2", True)]  # once each, each when complete
    assert waited and all(waited), "w2 was read before w13 was pinned"
    assert stats.pinned == ["w13"]
    for s in src.specs:
        assert torch.equal(_moe_rows(dst, s.name), _moe_rows(src, s.name))

    # a bit flip in w13's last chunk: no bank is pinned
    monkeypatch.setattr(pack_io, "_read_into", real_read)
    last = max((c for c in header["chunks"] if c.bank == "w13"), key=lambda c: c.offset)
    raw = bytearray(path.read_bytes())
    raw[last.offset + 5] ^= 1
    path.write_bytes(bytes(raw))
    calls.clear()
    with pytest.raises(fmt.PackRefused, match="fails its checksum"):
        pack_io.read_pack(path, dst, header["chunks"], threads=1, progress=False, pin=pin)
    assert calls == []


def test_killed_packer_leaves_nothing_loadable(tmp_path):
    """SIGKILL a packer (a forked child writing a 24 MB pool) at random points of its write;
    afterwards the pack path either does not exist or holds a complete, valid pack."""
    src = _pool(h=512, i=256)
    d = _model_dir(tmp_path)
    identity = fmt.model_identity(d)
    path = tmp_path / "k.pack"
    t0 = time.perf_counter()
    pack_io.write_pack(tmp_path / "timing.pack", src, E, MOE_LAYERS, identity, progress=False)
    full = time.perf_counter() - t0
    rng = random.Random(0)
    outcomes = []
    for _ in range(8):
        path.unlink(missing_ok=True)
        delay = rng.uniform(0, 1.5 * full)
        pid = os.fork()
        if pid == 0:  # the packer
            try:
                pack_io.write_pack(path, src, E, MOE_LAYERS, identity, progress=False)
            finally:
                os._exit(0)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if path.exists():
            assert _refusal(path, src, d) == "", "a killed packer left an invalid pack"
            outcomes.append("complete")
        else:
            outcomes.append("absent")
    assert "absent" in outcomes, f"no kill landed inside a write ({outcomes}, {full:.3f} s)"
    # the next pack removes the temporary files killed packers left
    pack_io.write_pack(path, src, E, MOE_LAYERS, identity, progress=False)
    assert not list(tmp_path.glob(".k.pack.tmp.*"))
    assert _refusal(path, src, d) == ""


def test_routed_expert_names():
    from sglang.srt.layers.moe.expert_cache.pack_load import is_routed_expert

    assert is_routed_expert("model.layers.3.mlp.experts.17.gate_proj.weight", {3})
    assert is_routed_expert("model.layers.3.mlp.experts.0.down_proj.weight_scale_inv", {3})
    assert not is_routed_expert("model.layers.3.mlp.experts.17.gate_proj.weight", {2})
    assert not is_routed_expert("model.layers.3.mlp.shared_expert.gate_proj.weight", {3})
    assert not is_routed_expert("model.layers.3.mlp.shared_experts.up_proj.weight", {3})
    assert not is_routed_expert("model.layers.3.mlp.gate.weight", {3})
    # a static input scale loads into a layer parameter, not a bank: streamed
    assert not is_routed_expert("model.layers.3.mlp.experts.4.up_proj.input_scale", {3})
    # all of a layer's experts in one tensor (gpt-oss, Gemma 4, Llama 4 as released)
    assert is_routed_expert("model.layers.3.mlp.experts.gate_up_proj_blocks", {3})
    assert is_routed_expert("model.layers.3.mlp.experts.down_proj_bias", {3})
    assert is_routed_expert("model.language_model.layers.3.experts.gate_up_proj", {3})
    assert is_routed_expert("language_model.model.layers.3.feed_forward.experts.down_proj", {3})
    assert not is_routed_expert("model.layers.3.mlp.experts.down_proj_bias", {2})
    assert not is_routed_expert(
        "language_model.model.layers.3.feed_forward.shared_expert.down_proj.weight", {3}
    )
    assert not is_routed_expert("model.language_model.layers.3.router.per_expert_scale", {3})
    assert is_routed_expert("model.layers.3.mlp.experts.down_proj", {3})
    assert not is_routed_expert("model.layers.3.mlp.experts.input_projection.weight", {3})
    assert not is_routed_expert("model.layers.3.mlp.experts.w13_weight", {3})


def test_checkpoint_load_progress_logged_once(caplog):
    import logging

    from sglang.srt.layers.moe.expert_cache.pack_load import with_progress

    w = torch.zeros(4, 8, dtype=torch.bfloat16)  # 64 bytes
    stream = [
        ("model.layers.1.mlp.experts.0.gate_proj.weight", w),
        ("model.layers.1.mlp.gate.weight", w),
        ("model.layers.2.mlp.experts.3.down_proj.weight", w),
        ("model.layers.0.mlp.experts.0.up_proj.weight", w),  # not a cache layer
    ]
    with caplog.at_level(logging.INFO):
        out = list(with_progress(iter(stream), {1, 2}, 128, progress=False))
    assert [n for n, _ in out] == [n for n, _ in stream] and all(t is w for _, t in out)
    lines = [
        r.getMessage() for r in caplog.records if "host pool from the checkpoint" in r.getMessage()
    ]
    assert len(lines) == 1, lines
    assert "2 routed expert tensors, 0.00 GB" in lines[0] and "GB/s" in lines[0]


def _pools(tmp_path_factory, quant, *flags, arch="qwen3_moe"):
    from sglang.test.tiny_models import build

    tmp = tmp_path_factory.mktemp(f"pack_model_{arch}_{quant or 'bf16'}")
    model = build(arch, tmp / f"{arch}-tiny", quant=quant)
    out = tmp / "pools.pt"
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", TORCHDYNAMO_DISABLE="1")
    env.pop(fmt.PACK_ENV, None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(model), str(out), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = torch.load(out)
    res["checkpoint_experts"] = _checkpoint_expert_tensors(model)
    return res, proc.stderr


def _checkpoint_expert_tensors(model: Path) -> int:
    """How many of the checkpoint's tensors are routed experts, counted by name without
    ``pack_load``'s pattern (``.experts.`` in the name: a shared expert is ``shared_expert.``
    or ``shared_experts.``)."""
    from safetensors import safe_open

    n = 0
    for f in Path(model).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(".experts." in k for k in st.keys())
    return n


@pytest.fixture(scope="module")
def model_results(tmp_path_factory):
    return _pools(tmp_path_factory, None)


def _assert_pack_load_matches_checkpoint(res, log, banks):
    """The pool (exactly ``banks``, each nonzero) and every other parameter loaded from the
    pack are bit-identical to the checkpoint load."""
    assert "loaded the host pool from the expert pack" in log
    ckpt, packed = res["checkpoint"], res["pack"]
    assert sorted(ckpt["banks"]) == sorted(banks), sorted(ckpt["banks"])
    for name in ckpt["banks"]:
        assert torch.equal(ckpt["banks"][name], packed["banks"][name]), name
        assert ckpt["banks"][name].any(), name
    assert ckpt["params"].keys() == packed["params"].keys()
    for n, p in ckpt["params"].items():
        assert torch.equal(p, packed["params"][n]), n


def test_fp8_pool_from_pack_bit_identical_to_checkpoint(tmp_path_factory):
    """The block-FP8 tiny model (``tiny_models --quant fp8``): the pool (FP8 weights and their
    ``weight_scale_inv`` banks) and every other parameter loaded from the pack are
    bit-identical to the checkpoint load (a second subprocess, ~25 s)."""
    res, log = _pools(tmp_path_factory, "fp8", "--no-corrupt")
    _assert_pack_load_matches_checkpoint(res, log, ["w13", "w13_scale", "w2", "w2_scale"])


def test_nvfp4_pool_from_pack_bit_identical_to_checkpoint(tmp_path_factory):
    """The ModelOpt NVFP4 tiny model (``tiny_models --quant nvfp4``): the six banks (e2m1
    weights, e4m3 block scales, the per-expert global scales of w13 and w2) and every other
    parameter loaded from the pack are bit-identical to the checkpoint load."""
    res, log = _pools(tmp_path_factory, "nvfp4", "--no-corrupt")
    assert len(res["checkpoint"]["banks"]) == 6, sorted(res["checkpoint"]["banks"])
    _assert_pack_load_matches_checkpoint(res, log, res["checkpoint"]["banks"])


@pytest.mark.parametrize("quant", ["ct-fp8", "ct-fp8-block", "ct-fp8-tensor"])
def test_compressed_tensors_fp8_pool_from_pack_bit_identical_to_checkpoint(tmp_path_factory, quant):
    """The compressed-tensors FP8 tiny models (``tiny_models --quant ct-fp8|ct-fp8-block|
    ct-fp8-tensor``: per-channel ``[2I, 1]`` / ``[H, 1]``, 128 x 128 block, or per-tensor
    scales held per row, ``weight_scale`` banks): the pool and every other parameter loaded
    from the pack (the per-tensor scheme's static ``w13_input_scale`` / ``w2_input_scale``
    included, streamed from the checkpoint) are bit-identical to the checkpoint load."""
    res, log = _pools(tmp_path_factory, quant, "--no-corrupt")
    _assert_pack_load_matches_checkpoint(res, log, ["w13", "w13_scale", "w2", "w2_scale"])


def test_gpt_oss_mxfp4_pool_from_pack_bit_identical_to_checkpoint(tmp_path_factory):
    """The tiny gpt-oss (MXFP4 as released, ``tiny_models --arch gpt_oss``): the six banks
    (e2m1 codes, e8m0 scales, gate/up and down biases, w13 tensors de-interleaved by the
    checkpoint's loaders) and every other parameter loaded from the pack are bit-identical to
    the checkpoint load: a pack is read without a second de-interleave."""
    res, log = _pools(tmp_path_factory, None, "--no-corrupt", arch="gpt_oss")
    _assert_fused_experts_skipped(res, log)
    _assert_pack_load_matches_checkpoint(
        res, log, ["w13", "w13_bias", "w13_scale", "w2", "w2_bias", "w2_scale"]
    )


def _assert_fused_experts_skipped(res, log):
    """Every checkpoint tensor holding a layer's routed experts fused (``...experts.gate_up_proj
    ...``; not the shared expert) is counted by the checkpoint load and skipped by the pack
    load, and none else is."""
    import re

    fused = res["checkpoint_experts"]
    assert fused > 0
    assert f"wrote the host pool from the checkpoint: {fused} routed expert tensors" in log
    assert re.search(rf"; {fused} expert tensors of the checkpoint skipped", log), log[-3000:]


def test_llama4_fused_pool_from_pack_bit_identical_to_checkpoint(tmp_path_factory):
    """The tiny Llama 4 (``tiny_models --arch llama4``: each layer's experts fused in
    ``feed_forward.experts.gate_up_proj`` / ``down_proj`` as released, beside an unfused
    ``shared_expert``): the pack load skips exactly the fused routed tensors, and the pool
    and every other parameter (the shared expert's included) are bit-identical to the
    checkpoint load."""
    res, log = _pools(tmp_path_factory, None, "--no-corrupt", arch="llama4")
    assert "loaded the host pool from the expert pack" in log
    _assert_fused_experts_skipped(res, log)
    ckpt, packed = res["checkpoint"], res["pack"]
    assert set(ckpt["banks"]) == {"w13", "w2"}
    for name in ckpt["banks"]:
        assert torch.equal(ckpt["banks"][name], packed["banks"][name]), name
        assert ckpt["banks"][name].any(), name
    assert any("shared_expert" in n for n in ckpt["params"])
    assert ckpt["params"].keys() == packed["params"].keys()
    for n, p in ckpt["params"].items():
        assert torch.equal(p, packed["params"][n]), n


def test_pool_from_pack_bit_identical_to_checkpoint(model_results):
    res, log = model_results
    assert "loaded the host pool from the expert pack" in log
    assert "768 expert tensors of the checkpoint skipped" in log  # 4 layers x 64 experts x 3
    ckpt, packed = res["checkpoint"], res["pack"]
    assert set(ckpt["banks"]) == {"w13", "w2"}
    for name in ckpt["banks"]:
        assert torch.equal(ckpt["banks"][name], packed["banks"][name]), name
        assert ckpt["banks"][name].any()
    assert ckpt["params"].keys() == packed["params"].keys()
    for n, p in ckpt["params"].items():
        assert torch.equal(p, packed["params"][n]), n


def test_corrupt_pack_falls_back_to_checkpoint(model_results):
    res, log = model_results
    # the ordinary loads (packer, corrupt fallback excluded) report the experts they wrote
    assert "wrote the host pool from the checkpoint: 768 routed expert tensors" in log
    assert "expert pack refused while reading" in log and "fails its checksum" in log
    assert "repack with `python -m sglang.srt.layers.moe.expert_cache.pack --model-path" in log
    for name, rows in res["checkpoint"]["banks"].items():
        assert torch.equal(rows, res["corrupt"]["banks"][name]), name


class _RecordingCudart:
    """``torch.cuda.cudart()`` that records each (un)registration instead of calling a driver."""

    def __init__(self):
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, ptr, nbytes, _flags):
        self.registered.append((ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_pin_registers_each_banks_whole_storage(monkeypatch):
    """``ExpertBanks.pin`` registers every bank from its storage's base address (what
    ``Tensor.is_pinned`` asks the driver about), which is also the bank's first byte (its own
    page-aligned mapping): a bank that was a view into a larger buffer, registered from the view's
    address, read as not pinned on a GPU and the bank copy refused the pool (the first GPU run of
    scripts/gpu_checks.sh). Unpinning unregisters the same addresses."""
    from sglang.srt.layers.moe.expert_cache import banks as banks_mod

    cudart = _RecordingCudart()
    monkeypatch.setattr(banks_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(banks_mod.torch.cuda, "cudart", lambda: cudart)
    host = ExpertBanks(BF16, 64, 32, 6, "cpu")
    assert host.pin() and host._registered
    spans = {}
    for name, t in host.tensors.items():
        base, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        assert base == t.data_ptr() and base % 4096 == 0
        assert nbytes == t.numel() * t.element_size()
        spans[name] = (base, nbytes)
    assert sorted(cudart.registered) == sorted(spans.values())
    assert host.pin() and len(cudart.registered) == len(spans)  # pinned once
    host.unpin()
    assert sorted(cudart.unregistered) == sorted(b for b, _ in spans.values())
    del host
    gc.collect()
    assert len(cudart.unregistered) == len(spans)  # unpinned already: not again when freed


def test_a_pinned_bank_is_unregistered_when_its_memory_is_freed(monkeypatch):
    """A pool dropped while pinned (a cache rebuilt, a test's pool) is unregistered with the
    driver once its mapping is freed: not while a view of a bank still holds it, and a
    registration of dead memory would make the next pool at that address unpinnable."""
    from sglang.srt.layers.moe.expert_cache import banks as banks_mod

    cudart = _RecordingCudart()
    monkeypatch.setattr(banks_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(banks_mod.torch.cuda, "cudart", lambda: cudart)
    host = ExpertBanks(BF16, 64, 32, 6, "cpu")
    assert host.pin()
    bases = sorted(t.data_ptr() for t in host.tensors.values())
    view = host["w2"][1:3]  # a view keeps its bank's mapping alive
    del host
    gc.collect()
    w13_base = [b for b in bases if b != view.untyped_storage().data_ptr()]
    assert cudart.unregistered == w13_base
    del view
    gc.collect()
    assert sorted(cudart.unregistered) == bases
