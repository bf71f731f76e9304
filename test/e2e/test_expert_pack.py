"""A server started from a packed expert pool (``expert_cache/pack_load.py``, patch 0050).

The tiny ``qwen3_moe`` model is copied to a temporary folder and packed with the packer's
command line; then two servers with ``--enable-expert-cache`` (one at a time): one finds the
pack in the model folder and logs that it filled the host pool from it, with the experts'
checkpoint tensors skipped; the other has packs off (``SGLANG_EXPERT_CACHE_PACK=off``) and
loads the checkpoint. Greedy tokens and every input and output logprob are identical. The
refusals (truncated, corrupt, stale, other version) and the fallback are checked at the
layer level (``test/expert_cache/test_pack.py``). Each server's start to its first token is
printed (one run each: a label, not a claim).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest
from conftest import TEST_SERVER_ARGS, model_path
from e2e_util import greedy_with_logprobs, random_prompts
from server import start_server

FLAGS = ["--enable-expert-cache", *TEST_SERVER_ARGS]


@pytest.fixture(scope="module")
def packed_model(tmp_path_factory):
    model = tmp_path_factory.mktemp("expert_pack") / "qwen3-moe-tiny"
    shutil.copytree(model_path("qwen3_moe"), model)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.srt.layers.moe.expert_cache.pack",
            "--model-path",
            str(model),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (model / "sglang-expert-pool.pack").is_file()
    return model


def _serve(model, env):
    t0 = time.perf_counter()
    srv = start_server(model, FLAGS, env=env)
    try:
        first = greedy_with_logprobs(srv.url, [[11, 12, 13]], 1)
        ttft = time.perf_counter() - t0
        outs = greedy_with_logprobs(srv.url, random_prompts(), 8)
        return outs, first, ttft, srv.log.read_text(errors="replace")
    finally:
        srv.stop()


def test_server_from_pack_equals_checkpoint(packed_model):
    packed, first_p, ttft_p, log_p = _serve(packed_model, {})
    plain, first_c, ttft_c, log_c = _serve(packed_model, {"SGLANG_EXPERT_CACHE_PACK": "off"})
    print(f"start to first token: pack {ttft_p:.1f} s, checkpoint {ttft_c:.1f} s (one run each)")
    assert "loaded the host pool from the expert pack" in log_p
    assert "768 expert tensors of the checkpoint skipped" in log_p
    assert "expert pack" not in log_c
    assert first_p == first_c
    assert packed == plain
