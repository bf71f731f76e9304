"""A tiny model's host pool built three ways in one fresh process (run by ``test_pack.py``).

It publishes SGLang's runtime context and a one-process gloo group, which must not leak into
other tests. Arguments: the model folder and an output file. In turn:

* ``checkpoint``: the packer (``pack.pack_model``: the experts from the checkpoint, then the
  pack written into the model folder);
* ``pack``: loaded as a server loads it (``load_pool(use_pack=True)``: from the pack);
* ``corrupt``: the same after one bit of the pack's last chunk is flipped (refused while
  reading: from the checkpoint).

A third argument ``--no-corrupt`` leaves out the third way (the block-FP8 model's run: the
refusal path is format-independent and checked once).

Writes, with ``torch.save``, per way: ``banks`` (bank name -> the MoE layers' rows as bytes)
and ``params`` (every other parameter). The loads' logs go to stderr.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch


def _snapshot(cache, net) -> dict:
    e = cache.num_experts

    def rows(t):
        return [
            t[x * e : (x + 1) * e].reshape(-1).view(torch.uint8) for x in sorted(cache.layer_ids)
        ]

    return dict(
        banks={name: torch.cat(rows(t)).clone() for name, t in cache.host.tensors.items()},
        params={n: p.detach().clone() for n, p in net.named_parameters() if ".experts." not in n},
    )


def main(model: str, out: str, *flags: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from sglang.srt.layers.moe.expert_cache import pack
    from sglang.srt.layers.moe.expert_cache import pack_format as fmt

    res = {}
    path = pack.pack_model(model, progress=False)
    res["checkpoint"] = _snapshot(*pack.load_pool(model, use_pack=False))
    res["pack"] = _snapshot(*pack.load_pool(model, use_pack=True))
    if "--no-corrupt" in flags:
        torch.save(res, out)
        return
    with open(path, "r+b") as f:
        f.seek(Path(path).stat().st_size - 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    assert fmt.read_header(path)  # the header still passes: only the data is bad
    res["corrupt"] = _snapshot(*pack.load_pool(model, use_pack=True))
    torch.save(res, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
