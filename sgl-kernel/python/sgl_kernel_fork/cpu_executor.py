"""CPU executor: routed MoE experts computed on the host (FreeToken §3.2, §4.1).

The paper splits each decode step's expert-cache misses into cache fills and a
CPU execution set; the experts of that set run here, on a persistent pool of
threads pinned to physical cores, reading bf16 expert banks in place (no weight
copy). On CPU-only machines the same op computes every routed expert (prefill
chunks included). C++ in ``csrc/cpu/cpu_executor.cpp`` (op),
``csrc/cpu/cpu_executor_pool.cpp`` (threads) and ``csrc/cpu/isa/cpu_executor_kernels.h``
(SIMD kernels: avx512bf16 with ``vdpbf16ps``, avx512, avx2, scalar; chosen like
every other op by ``sgl_kernel_fork.cpu_isa()`` / ``SGLANG_CPU_KERNEL_ISA``).

Formula, per token ``t`` (``x = hidden[t]``)::

    result[t] = sum over k = 0..K-1, in this order, of topk_weights[t, k] * expert(x)
    expert(x) = w2[r] @ h + b2[r],   h = bf16(act(g, u)),
    g = w13[r, :I] @ x + b13[r, :I],  u = w13[r, I:] @ x + b13[r, I:]

where ``r = expert_rows[i][t, k]`` for the one set ``i`` in which it is ``>= 0``
(entries that are -1 in every set contribute nothing). ``g``, ``u``, the down
projection and the k-sum are float32 (bf16 x bf16 products are exact in
float32); the biases (``w13_bias`` / ``w2_bias``, zero when not given) are added in float32
to the finished dots, the down bias before the routing weight (transformers'
``GptOssExperts``). The one rounding to bfloat16 is of ``h``, the input of the down
projection (as SGLang's bf16 MoE does, and as ``vdpbf16ps`` needs). The k-sum
is ``r = fma(w_k, y_k, r)`` from ``r = 0``; then ``out = out + r`` if
``accumulate`` else ``out = r``.

Activations (``activation``; names from ``SGLK_EXPERT_ACTIVATIONS``, :func:`expert_activations`)::

    silu          act(g, u) = silu(g) * u                        (default; SGLang's SiluAndMul)
    swiglu_oai    g' = min(g, limit), u' = clamp(u, -limit, limit)
                  act(g, u) = (u' + 1) * g' * sigmoid(alpha * g')  (gpt-oss; transformers'
                                                                  GptOssExperts._apply_gate,
                                                                  alpha 1.702, limit 7.0)
    swiglu_limit  act(g, u) = silu(min(g, limit)) * clamp(u, -limit, limit)
                                                                 (DeepSeek-V4's swiglu_limit;
                                                                  upstream swiglu_limit_func)
    gelu_tanh     act(g, u) = gelu_tanh(g) * u, gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi)
                  (g + 0.044715 g^3)))                           (Gemma 4: gelu_pytorch_tanh;
                                                                  SGLang's GeluAndMul)

Gate and up are always the two halves of ``w13`` (rows ``[0, I)`` and ``[I, 2I)``); a checkpoint
that interleaves them (gpt-oss: even rows gate, odd rows up) is de-interleaved once when its banks
are built (``sglang.srt.layers.moe.expert_cache.formats.deinterleave_gate_up``), weights, scales
and biases alike, so the kernels have one layout.

Exactness: for one ISA level, the output is bit-identical whatever the thread
count, however the (t, k) entries are split over sets (or banks), and however
many tokens are processed per call chunk: each dot product is computed whole by
one thread with a fixed operation order, each (t, k) output has its own float32
scratch row, and the k-sum runs in k order. So GPU-slot and CPU-pool partial
results of one routing merge exactly. Different ISA levels differ in the last
bits of the float32 sums (and so, rarely, in the bf16 rounding of an element of
``h``).

Quantized experts (``format``; weight-only: activations stay bf16, products and sums float32,
as above, with ``w13`` / ``w2`` meaning the dequantized weights). The banks are the layer quant
method's per-expert tensors exactly as upstream 0.5.23's ``create_weights`` makes them (leading
dimension the bank row), decoded in registers, never copied (``csrc/cpu/isa/cpu_executor_kernels.h``):

========  ===========================================  ===========================================
format    w13 / w2                                     w13_scale / w2_scale (+ nvfp4's globals)
========  ===========================================  ===========================================
bf16      ``[N, 2I, H]`` / ``[N, H, I]`` bfloat16      none
fp8       same shapes, ``float8_e4m3fn``               float32 ``[N, ceil(2I/128), ceil(H/128)]`` /
          (``Fp8MoEMethod``, block quantized)          ``[N, ceil(H/128), ceil(I/128)]``
                                                       (``w*_weight_scale_inv``): weight = fp8 *
                                                       the scale of its 128 x 128 block; or
                                                       per output channel ``[N, 2I, 1]`` /
                                                       ``[N, H, 1]`` (compressed-tensors
                                                       FP8-Dynamic, ``w*_weight_scale``):
                                                       weight = fp8 * the scale of its row
mxfp4     uint8 ``[N, 2I, H/2]`` / ``[N, H, I/2]``:    uint8 e8m0 ``[N, 2I, H/32]`` /
          two e2m1 codes per byte, element 2j in the   ``[N, H, I/32]`` (``w*_weight_scale``):
          low nibble (``Mxfp4MoEMethod``)              weight = e2m1 * 2^(scale - 127)
nvfp4     as mxfp4 (``ModelOptNvFp4FusedMoEMethod``,   ``float8_e4m3fn`` ``[N, 2I, H/16]`` /
          unswizzled)                                  ``[N, H, I/16]``; ``w13_scale_2`` float32
                                                       ``[N, 2]`` (gate, up) or ``[N]``,
                                                       ``w2_scale_2`` ``[N]``
                                                       (``w*_weight_scale_2``): weight = e2m1 *
                                                       fp8(scale) * global
========  ===========================================  ===========================================

mxfp4 and nvfp4 need H and I multiples of 32 / 16 (their group). e2m1 values are
0, 0.5, 1, 1.5, 2, 3, 4, 6 with a sign bit (code bit 3). Each dequantized weight is
``fp32(code value * scale)`` (nvfp4: ``scale = fp32(fp8(scale) * global)``), the same value at
every ISA level; the float64 references are ``sglang.srt.layers.moe.expert_cache.formats``.
Exactness across thread counts, bank-set splits and token chunks holds for every format.

Threads: created on first use, one per physical core of the process's affinity
set (``expert_pool_set_threads`` changes it), pinned with ``sched_setaffinity``;
idle threads spin ``SGLANG_CPU_EXPERT_SPIN_US`` microseconds (default 20) before
sleeping. Scratch per call: ``T*K*(4*H + 2*I)`` bytes, in token chunks of at
most ``SGLANG_CPU_EXPERT_SCRATCH_MB`` (default 64) MB, cached between calls.
"""

import math
from typing import Optional, Sequence, Tuple, Union

import torch

_ops = torch.ops.sgl_kernel


def expert_formats() -> list:
    """The ``format`` names in code order (``bf16``, ``fp8``, ``mxfp4``, ``nvfp4``), from the
    one definition, ``SGLK_EXPERT_FORMATS`` in ``csrc/cpu/isa/cpu_executor_args.h``."""
    return list(_ops.expert_cache_enum("expert_format"))


def format_code(fmt: Union[str, int]) -> int:
    """The op's ``format`` code of a name of :func:`expert_formats` (an int passes through).

    Raises:
        ValueError: an unknown name, with the supported list.
    """
    if isinstance(fmt, int):
        return fmt
    names = expert_formats()
    if fmt not in names:
        raise ValueError(
            f"unknown expert format {fmt!r}; the CPU executor reads {', '.join(names)}"
        )
    return names.index(fmt)


def expert_activations() -> list:
    """The ``activation`` names in code order (``silu``, ``swiglu_oai``, ``swiglu_limit``,
    ``gelu_tanh``), from
    ``SGLK_EXPERT_ACTIVATIONS`` in ``csrc/cpu/isa/cpu_executor_args.h``."""
    return list(_ops.expert_cache_enum("expert_activation"))


SWIGLU_OAI_ALPHA = 1.702  # gpt-oss (transformers' GptOssConfig.swiglu_alpha)
SWIGLU_OAI_LIMIT = 7.0  # gpt-oss (config.json swiglu_limit)


def activation_args(
    activation: Union[str, int] = "silu",
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
) -> Tuple[int, float, float]:
    """The op's ``(activation, alpha, limit)`` for an activation of :func:`expert_activations`.

    ``swiglu_oai`` defaults to gpt-oss's ``alpha = 1.702``, ``limit = 7.0``; ``swiglu_limit``
    needs ``limit`` (DeepSeek-V4's ``swiglu_limit``) and takes no ``alpha``; ``silu`` and
    ``gelu_tanh`` take neither. An int ``activation`` is an op code with the op's values (what this function
    returns): only checked, so a resolved triple passes through unchanged.

    Raises:
        ValueError: an unknown name or code, a parameter the activation does not take, a
            missing ``limit`` for ``swiglu_limit``, or a ``limit`` that is not finite and > 0.
    """
    names = expert_activations()
    if isinstance(activation, int):  # the op's own values (e.g. from activation_args): checked only
        if not 0 <= activation < len(names):
            raise ValueError(
                f"activation code {activation} is not one of 0..{len(names) - 1} ({names})"
            )
        alpha = SWIGLU_OAI_ALPHA if alpha is None else float(alpha)
        limit = SWIGLU_OAI_LIMIT if limit is None else float(limit)
        clamped = names[activation] not in ("silu", "gelu_tanh")
        if clamped and not (math.isfinite(limit) and limit > 0):
            raise ValueError(f"limit must be finite and > 0, got {limit}")
        if not math.isfinite(alpha):
            raise ValueError(f"alpha must be finite, got {alpha}")
        return activation, alpha, limit
    if activation not in names:
        raise ValueError(
            f"unknown activation {activation!r}; the CPU executor computes {', '.join(names)}"
        )
    if activation in ("silu", "gelu_tanh"):
        if alpha is not None or limit is not None:
            raise ValueError(
                f"activation {activation!r} takes no alpha / limit; use 'swiglu_oai' or "
                "'swiglu_limit'"
            )
        return names.index(activation), SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
    if activation == "swiglu_limit":
        if alpha is not None:
            raise ValueError(
                "activation 'swiglu_limit' takes no alpha (it is silu with clamps); use 'swiglu_oai'"
            )
        if limit is None:
            raise ValueError(
                "activation 'swiglu_limit' needs limit (the model config's swiglu_limit)"
            )
        alpha = SWIGLU_OAI_ALPHA
    alpha = SWIGLU_OAI_ALPHA if alpha is None else float(alpha)
    limit = SWIGLU_OAI_LIMIT if limit is None else float(limit)
    if not (math.isfinite(limit) and limit > 0):
        raise ValueError(f"limit must be finite and > 0, got {limit}")
    if not math.isfinite(alpha):
        raise ValueError(f"alpha must be finite, got {alpha}")
    return names.index(activation), alpha, limit


def _call_args(a: dict) -> tuple:
    """The op's positional arguments from the Python signature's values ``a``."""
    return (
        a["hidden"],
        a["topk_weights"],
        list(a["expert_rows"]),
        list(a["w13"]),
        list(a["w2"]),
        a["out"],
        a["accumulate"],
        *_quant_args(a["format"], a["w13_scale"], a["w2_scale"], a["w13_scale_2"], a["w2_scale_2"]),
        list(a["w13_bias"]),
        list(a["w2_bias"]),
        *activation_args(a["activation"], a["alpha"], a["limit"]),
    )


def _quant_args(format, w13_scale, w2_scale, w13_scale_2, w2_scale_2):
    return (
        format_code(format),
        list(w13_scale),
        list(w2_scale),
        list(w13_scale_2),
        list(w2_scale_2),
    )


__all__ = [
    "moe_experts_cpu",
    "moe_experts_cpu_submit",
    "moe_experts_cpu_wait",
    "expert_pool_set_threads",
    "expert_pool_info",
    "expert_pool_read_bandwidth",
    "expert_formats",
    "format_code",
    "expert_activations",
    "activation_args",
    "CpuBranchPlan",
]


def moe_experts_cpu(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_rows: Sequence[torch.Tensor],
    w13: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    out: torch.Tensor,
    accumulate: bool = False,
    format: Union[str, int] = "bf16",
    w13_scale: Sequence[torch.Tensor] = (),
    w2_scale: Sequence[torch.Tensor] = (),
    w13_scale_2: Sequence[torch.Tensor] = (),
    w2_scale_2: Sequence[torch.Tensor] = (),
    w13_bias: Sequence[torch.Tensor] = (),
    w2_bias: Sequence[torch.Tensor] = (),
    activation: Union[str, int] = "silu",
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
) -> None:
    """Routed experts on the CPU pool; blocks until ``out`` is written.

    Calls ``torch.ops.sgl_kernel.moe_experts_cpu`` (the GIL is released while
    the pool computes).

    Args:
        hidden: ``[T, H]`` bfloat16, contiguous: token activations.
        topk_weights: ``[T, K]`` float32: router weight of each (token, k).
        expert_rows: one ``[T, K]`` int32 tensor per bank set: the row of
            (t, k)'s expert in that set's banks, or -1 when (t, k) is not in
            that set. At most one set may hold a row >= 0 for a (t, k).
        w13: one ``[N_i, 2*I, H]`` bfloat16 contiguous bank per set, rows
            ``0..I-1`` the gate projection and ``I..2I-1`` the up projection
            (SGLang's ``w13_weight`` layout).
        w2: one ``[N_i, H, I]`` bfloat16 contiguous bank per set (SGLang's
            ``w2_weight``), ``N_i`` as in ``w13[i]``.
        out: ``[T, H]`` float32 contiguous, written in place.
        accumulate: ``out += result`` instead of ``out = result``.
        format: a name of :func:`expert_formats` or its code; for a quantized
            format ``w13`` / ``w2`` hold its packed weights (module doc table).
        w13_scale, w2_scale: one scale bank per set for a quantized format
            (empty for bf16).
        w13_scale_2, w2_scale_2: nvfp4 only: one global-scale tensor per set.
        w13_bias: empty (no bias) or one ``[N_i, 2*I]`` float32 or bfloat16 contiguous bank per
            set: the gate biases then the up biases (de-interleaved like ``w13``).
        w2_bias: empty or one ``[N_i, H]`` float32 or bfloat16 contiguous bank per set.
        activation, alpha, limit: the gated activation (module doc; :func:`activation_args`).

    Raises:
        RuntimeError: naming the argument to fix, for a wrong dtype, device,
            shape or contiguity (of a weight or scale bank: with the format and
            upstream's parameter it holds); ``expert_rows[i]`` whose K differs
            from ``topk_weights``; a row outside ``[0, N_i)`` (other than -1); a
            (t, k) with rows in two sets; ``expert_rows``, ``w13`` and ``w2``
            of unequal lengths (or empty); scale lists that do not match the
            format (one per set, none for bf16); an unknown format code; bias lists that are
            neither empty nor one per set, or a bias bank of the wrong shape / dtype.
        ValueError: an unknown format name; an unknown activation or parameters it does not
            take (:func:`activation_args`).
    """
    _ops.moe_experts_cpu(*_call_args(locals()))


def moe_experts_cpu_submit(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_rows: Sequence[torch.Tensor],
    w13: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    out: torch.Tensor,
    accumulate: bool = False,
    format: Union[str, int] = "bf16",
    w13_scale: Sequence[torch.Tensor] = (),
    w2_scale: Sequence[torch.Tensor] = (),
    w13_scale_2: Sequence[torch.Tensor] = (),
    w2_scale_2: Sequence[torch.Tensor] = (),
    w13_bias: Sequence[torch.Tensor] = (),
    w2_bias: Sequence[torch.Tensor] = (),
    activation: Union[str, int] = "silu",
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
) -> int:
    """Starts :func:`moe_experts_cpu` on the pool and returns at once.

    Arguments, formula and argument errors are those of :func:`moe_experts_cpu`
    (the arguments are checked, and the routing read, before this returns).
    The paper launches this CPU branch first and runs the GPU path meanwhile.

    Contract: every handle must be passed to :func:`moe_experts_cpu_wait`
    exactly once. Until then the op holds references to the tensors (they stay
    allocated), but the caller must not write ``hidden``, ``topk_weights``,
    ``expert_rows`` or the banks, nor read or write ``out``: the pool reads
    and writes them asynchronously. Calls run one after another on the pool in
    submission order.

    Returns:
        int handle for :func:`moe_experts_cpu_wait`.
    """
    return _ops.moe_experts_cpu_submit(*_call_args(locals()))


def moe_experts_cpu_wait(handle: int) -> None:
    """Blocks (GIL released) until the call of ``handle`` has written ``out``.

    Raises:
        RuntimeError: unknown handle (not returned by
            :func:`moe_experts_cpu_submit`, or already waited), or an error
            raised while the pool ran the call.
    """
    _ops.moe_experts_cpu_wait(handle)


def expert_pool_set_threads(n: int = 0) -> int:
    """Sets the pool's thread count and returns the count in use.

    ``n = 0`` selects one thread per physical core of the process's CPU
    affinity set (the default); ``n`` above the core count pins threads round
    robin. Waits for queued calls to finish, then restarts the threads (cost:
    milliseconds; meant for setup, tests and benchmarks, not per step).

    Raises:
        RuntimeError: ``n`` outside ``[0, 4096]``.
    """
    return _ops.expert_pool_set_threads(n)


def expert_pool_info() -> str:
    """One line describing the pool, starting it if needed, e.g.
    ``threads=2 pinned=2/2 cpus=0,1 physical_cores=2 allowed_cpus=2
    topology="sysfs topology within sched_getaffinity" isa=avx512bf16
    dot="vdpbf16ps (bf16 pairs, fp32 accumulate)" spin_us=20``. A CPU that
    could not be pinned shows as ``N(unpinned)``.
    """
    return _ops.expert_pool_info()


def expert_pool_read_bandwidth(buffer: torch.Tensor, passes: int = 1) -> float:
    """Sequential read bandwidth of the pool threads, in GB/s (1e9 bytes/s).

    Each pool thread streams one contiguous slice of ``buffer`` (any dtype,
    contiguous CPU tensor; use one far larger than the last-level cache)
    ``passes`` times with full-width SIMD loads; wall time of the whole job,
    thread wake-up included. This is the ceiling the decode path is compared
    with (``benchmark/cpu_executor/bench_kernel.py``).

    Raises:
        RuntimeError: non-contiguous or non-CPU buffer, ``passes < 1``, or a
            buffer under 256 bytes per thread.
    """
    return _ops.expert_pool_read_bandwidth(buffer, passes)


class CpuBranchPlan:
    """The CPU branch of an expert-slot cache as stream work: copy, host function, copy.

    FreeToken §4, "Graph-resident CPU execution": :meth:`enqueue` puts on the current CUDA
    stream (1) copies of ``hidden`` / ``topk_weights`` / ``cpu_rows`` into this plan's
    page-locked staging rows, (2) a host function (``cudaLaunchHostFunc``) that runs
    :func:`moe_experts_cpu` on those rows with the plan's banks, and (3) a copy of the result
    into ``out`` on the device. Nothing blocks the host and every address is fixed here, so a
    decode step that calls it inside ``torch.cuda.graph()`` captures the branch and replays it.
    C++: ``csrc/cpu/cpu_executor_plan.cpp``, ``csrc/cuda/cpu_branch_binding.cpp``.

    Calls of one plan must be ordered on one stream (they share the staging rows): one plan per
    stream of layer calls (two-batch overlap would need two). The plan lives until the process
    exits (a captured graph may replay it).

    Args:
        max_tokens: staging rows (the largest batch :meth:`enqueue` takes).
        top_k: K of ``topk_weights`` / ``cpu_rows``.
        w13: ``[N, 2*I, H]`` bf16 contiguous CPU bank (the host pool), or a
            quantized format's packed w13 bank.
        w2: ``[N, H, I]`` bf16 contiguous CPU bank (or the packed w2 bank).
        pin: page-lock the staging tensors (needs CUDA; False for CPU-only tests).
        format, w13_scale, w2_scale, w13_scale_2, w2_scale_2: as for
            :func:`moe_experts_cpu`, single tensors (one bank set) or None.
        w13_bias, w2_bias: the host pool's bias banks (``[N, 2*I]`` / ``[N, H]``, float32 or
            bf16) or None; activation, alpha, limit: as for :func:`moe_experts_cpu`.

    Raises:
        RuntimeError: banks of the wrong dtype, layout or device (the executor's checks).
        ValueError: an unknown activation or parameters it does not take.
    """

    def __init__(
        self,
        max_tokens: int,
        top_k: int,
        w13: torch.Tensor,
        w2: torch.Tensor,
        pin: bool = True,
        format: Union[str, int] = "bf16",
        w13_scale=None,
        w2_scale=None,
        w13_scale_2=None,
        w2_scale_2=None,
        w13_bias=None,
        w2_bias=None,
        activation: Union[str, int] = "silu",
        alpha: Optional[float] = None,
        limit: Optional[float] = None,
    ):
        H = w2.shape[1]
        alloc = dict(device="cpu", pin_memory=pin)
        self.max_tokens = max_tokens
        self.hidden = torch.zeros(max_tokens, H, dtype=torch.bfloat16, **alloc)
        self.weights = torch.zeros(max_tokens, top_k, dtype=torch.float32, **alloc)
        self.rows = torch.full((max_tokens, top_k), -1, dtype=torch.int32, **alloc)
        self.out = torch.zeros(max_tokens, H, dtype=torch.float32, **alloc)
        self.w13, self.w2 = w13, w2

        def one(t):
            return [] if t is None else [t]

        self.handle = _ops.moe_experts_cpu_plan(
            self.hidden,
            self.weights,
            self.rows,
            [w13],
            [w2],
            self.out,
            *_quant_args(format, one(w13_scale), one(w2_scale), one(w13_scale_2), one(w2_scale_2)),
            one(w13_bias),
            one(w2_bias),
            *activation_args(activation, alpha, limit),
        )

    def run(self, tokens: int) -> None:
        """Run the executor on staging rows ``0..tokens-1`` now (what the host function does).

        Raises:
            RuntimeError: ``tokens`` outside ``[0, max_tokens]``, or the executor's error (a
                row outside the bank).
        """
        _ops.moe_experts_cpu_run_plan(self.handle, tokens)

    def enqueue(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        cpu_rows: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Enqueue the branch on the current CUDA stream (see the class doc).

        Args:
            hidden: ``[T, H]`` bf16 contiguous CUDA tensor, ``T <= max_tokens``.
            topk_weights: ``[T, K]`` float32 contiguous CUDA tensor.
            cpu_rows: ``[T, K]`` int32 contiguous CUDA tensor: bank row of (t, k), or -1.
            out: ``[T, H]`` float32 contiguous CUDA tensor, written when the stream gets there.

        Raises:
            RuntimeError: wrong dtype, device, shape, unpinned staging, or ``T > max_tokens``.
                An executor error inside the host function (an internal bug: a row outside
                the bank) cannot raise there: it aborts the process with the message.
        """
        _ops.moe_experts_cpu_enqueue(
            hidden,
            topk_weights,
            cpu_rows,
            self.handle,
            self.hidden,
            self.weights,
            self.rows,
            self.out,
            out,
        )
