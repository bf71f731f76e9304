"""Host-pool load from a packed expert pool against the disk and against safetensors.

(Issue 16 names this ``benchmark/expert_pool_load.py``; benchmarks are grouped by area here.)

A Qwen3-30B-A3B-shaped slice (hidden 2048, expert size 768, 128 experts per layer, bf16;
``--layers`` MoE layers, 1.21 GB each) of random weights is built under ``--dir`` (default
``/tmp/bench_pool_load``, deleted afterwards): the pack (``pack_io.write_pack``) and a
safetensors checkpoint of the same experts under their checkpoint names
(``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``). Then, each in a fresh process
and with both files' pages dropped from the page cache first (``posix_fadvise(DONTNEED)``
after ``fsync``; ``O_DIRECT`` bypasses it anyway):

* ``disk``: one thread reading the pack file front to back with ``O_DIRECT`` into one 64 MiB
  aligned buffer (the disk's sequential direct-read bandwidth for a file of the same size);
* ``disk_fresh``: the same read, one thread, but into fresh memory of the pool's size (each
  64 MiB piece lands in new, untouched pages): the disk read plus the first touch of the
  pool's pages, which any load into new memory pays (for the record; not a ratio's base);
* ``pack``: ``pack_io.read_pack`` into fresh, exact-size host banks (``--threads`` readers,
  checksums verified);
* ``pack_noverify``: the same without checksums (their cost: ``verify_cost``);
* ``safetensors``: upstream's ``safetensors_weights_iterator`` over the checkpoint, each
  expert tensor copied into its bank rows (gate and up into ``w13``, down into ``w2``), as
  ``FusedMoE``'s weight loader does.

The disk's rate on a shared virtual disk moves by more than the target's margin from one minute
to the next, so ``disk``, ``pack`` and ``pack_noverify`` run ``--reps`` interleaved rounds (the
order of disk and pack alternating from round to round) and each ratio is the median of its
per-round ratios; ``disk_fresh`` and ``safetensors`` run once. Per-kind GB/s are medians.

Peak RSS is each process's ``ru_maxrss`` minus its RSS before the banks were allocated.
Last line: ``load_ratio`` (median per-round pack GB/s / disk GB/s, with its min and max
``load_ratio_range``), ``vs_safetensors`` (pack GB/s /
safetensors GB/s), ``rss_ratio`` (pack load's peak RSS growth / pool bytes), ``verify_cost``
(pack_noverify GB/s / pack GB/s: 1.0 means checksums cost nothing), ``fresh_ratio`` (pack GB/s
/ disk_fresh GB/s), and the raw figures.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

H, I, E = 2048, 768, 128


def _rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _banks(layers: int):
    from sglang.srt.layers.moe.expert_cache.banks import BF16, ExpertBanks

    return ExpertBanks(BF16, H, I, layers * E, "cpu")


def build(d: Path, layers: int) -> None:
    import torch
    from safetensors.torch import save_file

    from sglang.srt.layers.moe.expert_cache import pack_format as fmt
    from sglang.srt.layers.moe.expert_cache import pack_io

    d.mkdir(parents=True, exist_ok=True)
    pool = _banks(layers)
    for t in pool.tensors.values():
        t.view(torch.int16).random_(-16000, 16000)  # finite bf16 values
    state = {}
    for l in range(layers):
        for e in range(E):
            g = l * E + e
            p = f"model.layers.{l}.mlp.experts.{e}."
            state[p + "gate_proj.weight"] = pool["w13"][g, :I]
            state[p + "up_proj.weight"] = pool["w13"][g, I:]
            state[p + "down_proj.weight"] = pool["w2"][g]
    (d / "config.json").write_text(json.dumps(dict(hidden_size=H, moe_intermediate_size=I)))
    save_file(state, str(d / "model.safetensors"))
    del state
    identity = fmt.model_identity(d)
    pack_io.write_pack(d / fmt.PACK_FILE, pool, E, list(range(layers)), identity, progress=False)


def _direct_read(pack: Path, *, fresh: bool) -> dict:
    """Sequential single-thread O_DIRECT read of ``pack`` in 64 MiB requests: into one reused
    64 MiB buffer, or (``fresh``) into a new mapping of the file's size, so that every page is
    touched for the first time by the read as the pack reader's banks are."""
    chunk = 64 << 20
    size = pack.stat().st_size
    buf = memoryview(mmap.mmap(-1, (size if fresh else 0) + chunk))
    fd = os.open(pack, os.O_RDONLY | os.O_DIRECT)
    t0 = time.perf_counter()
    off = 0
    while off < size:
        n = os.preadv(fd, [buf[off : off + chunk] if fresh else buf[:chunk]], off)
        if n <= 0:
            break
        off += n
    dt = time.perf_counter() - t0
    os.close(fd)
    return dict(bytes=off, seconds=dt, rss_growth=0)


def child(kind: str, d: Path, layers: int, threads: int) -> dict:
    from sglang.srt.layers.moe.expert_cache import pack_format as fmt
    from sglang.srt.layers.moe.expert_cache import pack_io

    pack = d / fmt.PACK_FILE
    base = _rss()
    if kind in ("disk", "disk_fresh"):
        return _direct_read(pack, fresh=kind == "disk_fresh")
    banks = _banks(layers)
    if kind in ("pack", "pack_noverify"):
        header = fmt.read_header(pack)
        s = pack_io.read_pack(
            pack,
            banks,
            header["chunks"],
            threads=threads,
            progress=False,
            verify=kind == "pack",
        )
        nbytes, dt, direct = s.nbytes, s.seconds, s.direct_bytes
    else:
        from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

        t0 = time.perf_counter()
        nbytes, direct = 0, 0
        for name, w in safetensors_weights_iterator([str(d / "model.safetensors")]):
            parts = name.split(".")
            g = int(parts[2]) * E + int(parts[5])
            role = parts[6]
            dst = {
                "gate_proj": banks["w13"][g, :I],
                "up_proj": banks["w13"][g, I:],
                "down_proj": banks["w2"][g],
            }[role]
            dst.copy_(w)
            nbytes += w.numel() * w.element_size()
        dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(bytes=nbytes, seconds=dt, rss_growth=peak - base, direct_bytes=direct)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds of disk and pack")
    ap.add_argument("--dir", default="/tmp/bench_pool_load")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    d = Path(a.dir)
    if a.child:
        print(json.dumps(child(a.child, d, a.layers, a.threads)))
        return
    rounds = []  # one {kind: result} per round
    try:
        build(d, a.layers)
        for r in range(a.reps):
            pair = ("disk", "pack") if r % 2 == 0 else ("pack", "disk")
            kinds = pair + ("pack_noverify",) + (("disk_fresh", "safetensors") if r == 0 else ())
            rounds.append({})
            for kind in kinds:
                res = _run_child(kind, d, a)
                rounds[-1][kind] = res
                print(
                    f"round {r} {kind}: {res['bytes'] / 1e9:.2f} GB in {res['seconds']:.2f} s = "
                    f"{_gbps(res):.2f} GB/s, peak RSS growth {res['rss_growth'] / 1e9:.2f} GB"
                )
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)

    def med(kind: str) -> float:
        return statistics.median(_gbps(r[kind]) for r in rounds if kind in r)

    def med_ratio(num: str, den: str) -> tuple:
        xs = [_gbps(r[num]) / _gbps(r[den]) for r in rounds]
        return statistics.median(xs), min(xs), max(xs)

    load_ratio, lo, hi = med_ratio("pack", "disk")
    verify_cost = med_ratio("pack_noverify", "pack")[0]
    first = rounds[0]
    pool_bytes = first["pack"]["bytes"]
    rss = max(r["pack"]["rss_growth"] for r in rounds)
    load = os.getloadavg()
    print(
        f"load_ratio={load_ratio:.3f} load_ratio_range={lo:.3f}-{hi:.3f} "
        f"vs_safetensors={med('pack') / med('safetensors'):.3f} "
        f"rss_ratio={rss / pool_bytes:.3f} pack_gbps={med('pack'):.3f} "
        f"disk_gbps={med('disk'):.3f} safetensors_gbps={med('safetensors'):.3f} "
        f"verify_cost={verify_cost:.3f} "
        f"fresh_ratio={med('pack') / med('disk_fresh'):.3f} disk_fresh_gbps={med('disk_fresh'):.3f} "
        f"pool_gb={pool_bytes / 1e9:.2f} direct_share={first['pack']['direct_bytes'] / pool_bytes:.3f} "
        f"reps={a.reps} threads={a.threads} loadavg={load[0]:.2f}"
    )


def _gbps(res: dict) -> float:
    return res["bytes"] / res["seconds"] / 1e9


def _run_child(kind: str, d: Path, a) -> dict:
    """One load of ``kind`` in a fresh process, after dropping every file's cached pages."""
    for f in d.iterdir():
        _drop(f)
    cmd = [sys.executable, __file__, "--child", kind, "--dir", str(d)]
    cmd += ["--layers", str(a.layers), "--threads", str(a.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
