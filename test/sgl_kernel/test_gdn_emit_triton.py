"""Upstream's Triton gated-delta chunk kernel with ``state_emit_indices`` (patch 0048): emit
mode's CUDA path (anchor checkpoints written inside the prefill pass), with the contract of the
CPU op's argument (``test_gdn_emit.py``).

Through upstream's call chain (``fla.chunk.chunk_gated_delta_rule``, as
``TritonGDNKernel.extend`` calls it), every emitted state must equal

1. the final state that a pass over the same tokens ending at that position writes back, bit
   for bit (the same fp32 recurrence, rounded once to the pool dtype);
2. the fp32 snapshot of the same chunk that upstream's ``track_state`` takes, rounded once to the
   pool dtype (``chunk_gated_delta_rule_fwd_h``; ``track_state`` keeps working beside it);
3. a float64 token-by-token reference of the gated delta rule, within the error of the kernel's
   half-precision dot operands (relative Frobenius error; ``REL_TOL``).

Outputs, final states and every slot not named are unchanged. The conv rows of emit mode
(``StateEmission.write_conv_states``) must equal the conv state that upstream's Triton
``causal_conv1d_fn`` leaves after a pass ending there.

Where it runs:

* CUDA: ``scripts/gpu_checks.sh`` (its ``tests`` step), bf16 inputs as the model runs them.
* No GPU: Triton 3.6's interpreter, fp16 inputs (its numpy emulation gets bfloat16 arithmetic
  wrong: the chain's outputs overflow; fp16 and fp32 agree with the CPU op). It needs a numpy
  that still converts a one-element array to a Python int (numpy 2.2 does, 2.4 raises
  ``TypeError: only 0-dimensional arrays can be converted to Python scalars``, the error a first
  try hit; the interpreter holds every scalar as a shape-(1,) array), so on this machine::

      pip install --target /tmp/np22 numpy==2.2.6     # once; triton 3.6 likewise, or a wheel
      PYTHONPATH=/tmp/np22:/tmp/tri36/site TRITON_INTERPRET=1 \\
          .venv/bin/python -m pytest test/sgl_kernel/test_gdn_emit_triton.py

  Later Triton interpreters refuse upstream's block pointers ("Block pointers have been
  removed", the venv's 3.9), so CI, which has neither a GPU nor Triton 3.6, skips this file
  with the reason. For the interpreter a fixture changes three host-side things, none of the
  kernels' code: module-level aliases of ``triton.language`` builtins in upstream's fla modules
  (``exp = tl.exp`` in ``op.py``) are bound late, since the interpreter patches ``tl.exp`` at
  launch and an alias taken at import keeps the compiled-mode builtin; each autotuned kernel
  of the chain keeps its first config (the interpreter has no driver to time them); and
  ``fla.utils.custom_device_ctx`` is a null context (``torch.cpu`` has no ``device``).
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

ON_CUDA = torch.cuda.is_available()


def _interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run upstream's kernels here, or None."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "needs CUDA, or Triton 3.6's interpreter (TRITON_INTERPRET=1 and numpy <= 2.2: "
            "see the module docstring)"
        )
    try:
        import numpy as np
        import triton
    except ImportError as e:
        return f"the Triton interpreter needs triton and numpy ({e})"
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) > (3, 6):
        return (
            f"Triton {triton.__version__}'s interpreter refuses upstream's block pointers; "
            "use Triton 3.6 (see the module docstring)"
        )
    try:
        int(np.array([1]))
    except TypeError:
        return (
            f"numpy {np.__version__} cannot convert the interpreter's shape-(1,) scalars to int; "
            "put numpy 2.2 first on PYTHONPATH (see the module docstring)"
        )
    return None


_WHY_NOT = None if ON_CUDA else _interpreter_problem()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")

DEVICE = "cuda" if ON_CUDA else "cpu"
# Input dtype: bf16 as the model runs it on CUDA; fp16 under the interpreter (see above).
IO_DTYPE = torch.bfloat16 if ON_CUDA else torch.float16
# Relative Frobenius error against float64: the kernel's dots take half-precision operands.
REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
FLA = "sglang.kernels.ops.attention.fla"


@pytest.fixture(autouse=True)
def _interpreter_host_shims(monkeypatch):
    """Under the interpreter only: the three host-side changes of the module docstring."""
    if ON_CUDA:
        yield
        return
    import triton.language as tl
    from triton.runtime.autotuner import Autotuner

    import sglang.kernels.ops.attention.fla.chunk  # noqa: F401  (imports the whole chain)
    import sglang.kernels.ops.attention.fla.utils as fla_utils

    monkeypatch.setattr(fla_utils, "custom_device_ctx", lambda index: contextlib.nullcontext())
    owners = [(tl, vars(tl)), (tl.math, vars(tl.math))]
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(FLA):
            continue
        for attr, val in list(vars(mod).items()):
            if tl.core.is_builtin(val):
                for owner, members in owners:
                    oname = next((n for n, m in members.items() if m is val), None)
                    if oname is not None:

                        def late(*a, _owner=owner, _name=oname, **k):
                            return getattr(_owner, _name)(*a, **k)

                        monkeypatch.setattr(mod, attr, late)
                        break
            node = val
            while node is not None and hasattr(node, "fn"):
                if isinstance(node, Autotuner) and len(node.configs) > 1:
                    monkeypatch.setattr(node, "configs", node.configs[:1])
                node = getattr(node, "fn", None)
    yield


def cu_of(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEVICE)


def make_inputs(T, H, HV, K, V, dtype):
    """q, k ``[1, T, H, K]``, v ``[1, T, HV, V]`` in ``dtype``; g (log decay, < 0) and beta
    ``[1, T, HV]`` fp32 (what ``GDNAttnBackend._prefill_gates`` gives the kernel)."""
    q = torch.randn(1, T, H, K).to(dtype)
    k = torch.randn(1, T, H, K).to(dtype)
    v = torch.randn(1, T, HV, V).to(dtype)
    A = torch.empty(HV).uniform_(0.05, 1.0)
    g = -A * torch.nn.functional.softplus(torch.randn(1, T, HV) - 2)
    beta = torch.sigmoid(torch.randn(1, T, HV))
    return [x.to(DEVICE) for x in (q, k, v, g, beta)]


def run(q, k, v, g, beta, pool, idx, cu, emit=None):
    """Upstream's chunked prefill as ``TritonGDNKernel.extend`` calls it; returns ``o``."""
    from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule

    kwargs = {} if emit is None else {"state_emit_indices": emit}
    o, _, _ = chunk_gated_delta_rule(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        initial_state=pool,
        initial_state_indices=idx,
        cu_seqlens=cu,
        head_first=False,
        use_qk_l2norm_in_kernel=True,
        **kwargs,
    )
    return o


def ref_states(q, k, v, g, beta, init):
    """Float64 token by token, one sequence: the state ``[HV, V, K]`` after each token."""
    q, k, v, g, beta = (x[0].double().cpu() for x in (q, k, v, g, beta))
    HV, group = v.shape[1], v.shape[1] // q.shape[1]
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)  # l2norm_fwd's eps
    S = init.double().cpu().clone()
    out = []
    for t in range(q.shape[0]):
        for hv in range(HV):
            kt = k[t, hv // group]
            S[hv] *= torch.exp(g[t, hv])
            u = beta[t, hv] * (v[t, hv] - S[hv] @ kt)
            S[hv] += torch.outer(u, kt)
        out.append(S.clone())
    return out


def rel_err(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


LENS = [200, 64, 130]  # 4, 1 and 3 chunks of 64
WANTED = {(0, 64): 5, (0, 128): 9, (0, 192): 1, (2, 128): 11}  # (sequence, tokens) -> slot
OWN = [3, 0, 7]


def emit_table(lens, wanted):
    chunk0 = [0]
    for n in lens:
        chunk0.append(chunk0[-1] + (n + 63) // 64)
    emit = torch.full((chunk0[-1],), -1, dtype=torch.int64)
    for (i, pos), slot in wanted.items():
        emit[chunk0[i] + pos // 64] = slot
    return emit.to(DEVICE)


def shapes():
    # K = 128 takes the kernel's second 64-wide state block (Qwen3-Next's head_k_dim).
    return (2, 4, 128, 128) if ON_CUDA else (1, 2, 128, 32)


@pytest.mark.parametrize("state_dtype", [torch.float32, IO_DTYPE])
def test_emitted_states_equal_a_pass_ending_there(state_dtype):
    H, HV, K, V = shapes()
    q, k, v, g, beta = make_inputs(sum(LENS), H, HV, K, V, IO_DTYPE)
    n_slots = 12
    pool0 = (torch.randn(n_slots, HV, V, K) * 0.5).to(state_dtype).to(DEVICE)
    idx = torch.tensor(OWN, dtype=torch.int32, device=DEVICE)
    cu = cu_of(LENS)
    pool = pool0.clone()
    out = run(q, k, v, g, beta, pool, idx, cu, emit_table(LENS, WANTED))

    # the same pass without emission: identical outputs and final states
    plain = pool0.clone()
    out_plain = run(q, k, v, g, beta, plain, idx, cu)
    assert torch.equal(out, out_plain)
    assert torch.equal(pool[idx.long()], plain[idx.long()])
    untouched = torch.ones(n_slots, dtype=torch.bool)
    untouched[OWN] = False
    untouched[list(WANTED.values())] = False
    assert torch.equal(pool[untouched.to(DEVICE)], pool0[untouched.to(DEVICE)])

    for (i, pos), slot in WANTED.items():
        s = int(cu[i])
        sl = slice(s, s + pos)
        part = [x[:, sl].contiguous() for x in (q, k, v, g, beta)]
        # (1) a pass over the first `pos` tokens of the sequence ends there: its write-back
        short = pool0.clone()
        run(*part, short, idx[i : i + 1].contiguous(), cu_of([pos]))
        assert torch.equal(pool[slot], short[OWN[i]]), (i, pos)
        # (3) token by token, float64
        ref = ref_states(*part, pool0[OWN[i]].float())[-1]
        err = rel_err(pool[slot], ref)
        assert err < REL_TOL[IO_DTYPE], (i, pos, err)


def test_emission_beside_track_state_is_the_snapshot_rounded_once():
    """At the kernel (``chunk_gated_delta_rule_fwd_h``), with upstream's ``track_state`` on the
    same chunk: the emitted state is the fp32 snapshot rounded once to the pool dtype, and the
    snapshot is the per-chunk state ``h`` would hold in fp32."""
    from sglang.kernels.ops.attention.fla.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    B, T, H, K, V = 1, 192, 2, 128, 64 if ON_CUDA else 32
    lens = [192]
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).to(IO_DTYPE).to(DEVICE)
    w = (torch.randn(B, T, H, K) * 0.1).to(IO_DTYPE).to(DEVICE)
    u = torch.randn(B, T, H, V).to(IO_DTYPE).to(DEVICE)
    g = (-torch.rand(B, T, H) * 0.05).to(DEVICE)
    # chunk_local_cumsum's output: the log decay summed within each 64-token chunk
    g = torch.cat([g[:, c : c + 64].cumsum(1) for c in range(0, T, 64)], 1)
    pool0 = (torch.randn(4, H, V, K) * 0.5).to(IO_DTYPE).to(DEVICE)
    idx = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    cu = cu_of(lens)

    def go(pool, **kw):
        return chunk_gated_delta_rule_fwd_h(
            k=k, w=w, u=u, g=g, initial_state=pool, initial_state_indices=idx, cu_seqlens=cu, **kw
        )

    pool = pool0.clone()
    track = torch.zeros(1, H, V, K, dtype=torch.float32, device=DEVICE)
    emit = torch.tensor([-1, -1, 0], dtype=torch.int64, device=DEVICE)  # chunk 2: 128 tokens
    h, v_new = go(
        pool,
        track_state=track,
        track_chunk_idx=torch.tensor([2], dtype=torch.int32, device=DEVICE),
        state_emit_indices=emit,
    )
    assert torch.equal(pool[0], track[0].to(pool.dtype))
    assert torch.equal(h[0, 2], track[0].to(h.dtype))
    plain = pool0.clone()
    h_plain, v_plain = go(plain)
    assert torch.equal(h, h_plain) and torch.equal(v_new, v_plain)
    assert torch.equal(pool[1:], plain[1:])


@pytest.mark.parametrize(
    "emit,match",
    [
        ([-1, 2], "one entry per 64-token chunk"),
        ([[-1, 2, -1, -1]], "one entry per 64-token chunk"),
        ([-1.0, 2.0, -1.0, -1.0], "int32 or int64"),
    ],
)
def test_emit_table_errors(emit, match):
    H, HV, K, V = 1, 2, 64, 32
    lens = [100, 100]
    q, k, v, g, beta = make_inputs(sum(lens), H, HV, K, V, IO_DTYPE)
    pool = torch.zeros(4, HV, V, K, device=DEVICE)
    idx = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        run(q, k, v, g, beta, pool, idx, cu_of(lens), torch.tensor(emit, device=DEVICE))


def test_emitted_conv_states_equal_a_pass_ending_there():
    """``StateEmission.write_conv_states`` on the kernels' device: the conv rows it copies into
    each emitted slot equal the conv state upstream's conv leaves after a pass ending there, for
    a request with a cached prefix (its initial conv state) and one without."""
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_fn
    from sglang.srt.mem_cache.anchor_checkpoints.emit import RowEmission, StateEmission

    dim, W = 96, 4
    lens, starts = [200, 130], [100, 0]  # row 0 continues a 100-token prefix
    T = sum(lens)
    x = torch.randn(T, dim, dtype=IO_DTYPE, device=DEVICE)
    weight = torch.randn(dim, W, dtype=IO_DTYPE, device=DEVICE)
    bias = torch.randn(dim, dtype=IO_DTYPE, device=DEVICE)
    pool0 = torch.randn(8, dim, W - 1, dtype=IO_DTYPE, device=DEVICE)
    own = [0, 1]
    plan = StateEmission(
        req_pool_indices=(0, 1),
        extend_lens=tuple(lens),
        rows=[RowEmission(0, 100, [164, 292], [4, 5]), RowEmission(1, 0, [128], [6])],
    )
    pool = pool0.clone()
    plan.write_conv_states(pool, x, lens)
    untouched = [0, 1, 2, 3, 7]
    assert torch.equal(pool[untouched], pool0[untouched])
    tok0 = [0, lens[0]]
    for row, pos, slot in [(0, 164, 4), (0, 292, 5), (1, 128, 6)]:
        n = pos - starts[row]
        part = x[tok0[row] : tok0[row] + n]
        short = pool0.clone()
        causal_conv1d_fn(
            part.transpose(0, 1),
            weight,
            bias,
            activation="silu",
            conv_states=short,
            has_initial_state=torch.tensor([starts[row] > 0], device=DEVICE),
            cache_indices=torch.tensor([own[row]], dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
            seq_lens_cpu=[n],
        )
        assert torch.equal(pool[slot], short[own[row]]), (row, pos)


@pytest.mark.skipif(
    not ON_CUDA,
    reason="TritonGDNKernel runs upstream's Triton chain on CUDA only (the CPU op on the CPU)",
)
def test_triton_gdn_kernel_extend_forwards_the_emission_on_cuda():
    """Patch 0048's ``TritonGDNKernel.extend``: on CUDA it passes ``state_emit_indices`` to the
    chain, as ``GDNAttnBackend.forward_extend`` calls it; the same pool as calling the chain."""
    from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel

    assert TritonGDNKernel.supports_state_emit
    H, HV, K, V = shapes()
    q, k, v, g, beta = make_inputs(sum(LENS), H, HV, K, V, IO_DTYPE)
    pool0 = (torch.randn(12, HV, V, K) * 0.5).to(DEVICE)
    idx = torch.tensor(OWN, dtype=torch.int32, device=DEVICE)
    cu, emit = cu_of(LENS), emit_table(LENS, WANTED)
    direct = pool0.clone()
    out = run(q, k, v, g, beta, direct, idx, cu, emit)
    via = pool0.clone()
    got, _, _ = TritonGDNKernel().extend(
        q,
        k,
        v,
        g,
        beta,
        ssm_states=via,
        cache_indices=idx,
        query_start_loc=cu,
        state_emit_indices=emit,
    )
    assert torch.equal(got, out)
    assert torch.equal(via, direct)
    assert not torch.equal(via[list(WANTED.values())], pool0[list(WANTED.values())])
