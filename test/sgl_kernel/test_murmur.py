"""murmur_hash32_cpu vs a plain-Python MurmurHash3_x86_32 of the same 16-byte key
(upstream: sglang/kernels/ops/sampling/murmur_hash.py)."""

import struct

import torch

M32 = 0xFFFFFFFF


def murmur3_32(data: bytes, seed: int = 0) -> int:
    c1, c2 = 0xCC9E2D51, 0x1B873593
    h = seed
    for i in range(0, len(data), 4):
        (k,) = struct.unpack_from("<I", data, i)
        k = (k * c1) & M32
        k = ((k << 15) | (k >> 17)) & M32
        k = (k * c2) & M32
        h ^= k
        h = ((h << 13) | (h >> 19)) & M32
        h = (h * 5 + 0xE6546B64) & M32
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    h ^= h >> 16
    return h


def test_murmur_hash32():
    seed = torch.tensor([0, 1, 2**40 + 7, 2**63 + 5], dtype=torch.uint64)
    positions = torch.tensor([0, 17, 2**33 + 3, 5], dtype=torch.int64)  # truncated to 32 bits
    cols = torch.arange(37, dtype=torch.int64)
    out = torch.ops.sgl_kernel.murmur_hash32_cpu.default(seed, positions, cols)
    assert out.dtype == torch.uint32 and out.shape == (4, 37)
    for r in range(4):
        s = int(seed[r].item()) & ((1 << 64) - 1)
        p = int(positions[r]) & M32
        for c in range(37):
            key = struct.pack("<IIII", s & M32, s >> 32, p, c)
            assert int(out[r, c].item()) == murmur3_32(key), (r, c)
