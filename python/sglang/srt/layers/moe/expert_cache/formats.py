"""Quantized expert formats: their banks, float64 dequantize references and test quantizers.

Each format keeps an expert in the exact per-expert tensors of the upstream 0.5.23 quant method
that loads it (names, dtypes, shapes of its ``create_weights``), so the host pool holds the
checkpoint's bytes and the CPU executor decodes them in registers
(``sgl_kernel_fork.cpu_executor``, format codes ``SGLK_EXPERT_FORMATS``):

======  ============================  =============================================  =========
format  upstream method               per-expert tensors (bank name: layer param)    bytes/elt
======  ============================  =============================================  =========
fp8     ``Fp8MoEMethod`` (block       w13, w2: ``w*_weight`` float8_e4m3fn; w13_scale,  ~1
        128 x 128)                    w2_scale: ``w*_weight_scale_inv`` float32
        ``CompressedTensorsW8A8-      as fp8; scales ``w*_weight_scale``: per output   ~1
        Fp8MoE`` (per channel, per    channel [2I, 1] / [H, 1] (:data:`CT_FP8_CHANNEL`;
        tensor or block 128 x 128)    per tensor: :data:`CT_FP8_TENSOR` writes each
                                      projection's scale on its rows) or per 128 x 128
                                      block (:data:`CT_FP8_BLOCK`)
mxfp4   ``Mxfp4MoEMethod``            w13, w2: ``w*_weight`` uint8 (two e2m1 codes);   ~0.53
                                      w13_scale, w2_scale: ``w*_weight_scale`` e8m0
nvfp4   ``ModelOptNvFp4FusedMoE``     as mxfp4, scales float8_e4m3fn per 16;           ~0.56
                                      w13_scale_2, w2_scale_2: ``w*_weight_scale_2``
======  ============================  =============================================  =========

gpt-oss's experts (``Mxfp4MoEMethod`` with ``with_bias``) add two bias banks to mxfp4's
(:data:`MXFP4_BIASED`): ``w13_bias`` [2I] (``w13_weight_bias``) and ``w2_bias`` [H]
(``w2_weight_bias``), bfloat16 as the method creates them. Their checkpoint interleaves the
gate and up rows of every w13 tensor; the host pool holds them de-interleaved
(:func:`deinterleave_gate_up`, applied by ``loading.deinterleaving_loader``).

The layer's tensors are found as upstream's paged experts finds them (``expert_params``: the
``w13_`` / ``w2_`` parameters with one row per expert); :meth:`QuantExpertFormat.layer_tensors`
maps them to bank names and says which one is missing. The dequantize references are what the
executor's tests and benchmark compare against (weight-only: activations stay bf16). Upstream's
``MXFP4QuantizeUtil.quantize`` cannot be reused (it constructs its class with arguments the class
does not take), so the quantizers here are written from the formats' definitions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

import torch

from sglang.srt.layers.moe.expert_cache.banks import BankSpec, ExpertFormat

FP8_BLOCK = 128  # fp8: rows and columns of a scale block
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7; bit 3 is the sign
FP8_MAX = 448.0
E2M1_MAX = 6.0


@dataclass(frozen=True)
class QuantExpertFormat(ExpertFormat):
    """A quantized :class:`ExpertFormat`: ``name`` is the executor's format name, ``group`` the
    elements along K per scale (fp8: the 128-wide block)."""

    name: str = ""
    group: int = 0
    biases: bool = False  # per-expert bias banks w13_bias [2I] / w2_bias [H] (bf16)
    # fp8 only: one scale per output channel ([2I, 1] / [H, 1]) instead of per 128 x 128 block
    channel: bool = False
    # fp8 only: the layer parameter of the scales, ``w13_<scale_param>`` / ``w2_<scale_param>``
    # (Fp8MoEMethod: weight_scale_inv; compressed-tensors: weight_scale)
    scale_param: str = "weight_scale_inv"
    # fp8 only: the method creates one scale per projection (``w13_<scale_param>`` [E, 2]: gate,
    # up; ``w2_<scale_param>`` [E]); the banks hold it per output channel (``channel``), each
    # row its projection's scale (written by ``loading.per_tensor_scale_loader``)
    per_tensor: bool = False
    # per-expert layer parameters that are not banks: kept on the layer, never read (the
    # static ``w13_input_scale`` / ``w2_input_scale`` [E] of a per-tensor FP8 scheme)
    unread: Tuple[str, ...] = ()

    @property
    def quantized(self) -> bool:
        """Always: the weights carry scale banks (the activations stay bf16)."""
        return True

    @property
    def executor_format(self) -> str:
        return self.name

    def banks(self, hidden_size: int, intermediate_size: int) -> Tuple[BankSpec, ...]:
        """The banks of an expert with hidden size H and intermediate size I (upstream's shapes;
        see the module table). Raises ValueError when H or I is not a multiple of the group
        (4-bit formats)."""
        h, i, g = hidden_size, intermediate_size, self.group
        if self.name == "fp8":
            c = lambda n: math.ceil(n / g)  # noqa: E731
            s13, s2 = ((2 * i, 1), (h, 1)) if self.channel else ((c(2 * i), c(h)), (c(h), c(i)))
            p = self.scale_param
            return (
                BankSpec("w13", "w13_weight", (2 * i, h), torch.float8_e4m3fn),
                BankSpec("w2", "w2_weight", (h, i), torch.float8_e4m3fn),
                BankSpec("w13_scale", f"w13_{p}", s13, torch.float32),
                BankSpec("w2_scale", f"w2_{p}", s2, torch.float32),
            )
        if h % g or i % g:
            raise ValueError(
                f"{self.name} experts need hidden and intermediate sizes that are multiples of "
                f"{g}, got {h} and {i}"
            )
        sdt = torch.uint8 if self.name == "mxfp4" else torch.float8_e4m3fn
        specs = (
            BankSpec("w13", "w13_weight", (2 * i, h // 2), torch.uint8),
            BankSpec("w2", "w2_weight", (h, i // 2), torch.uint8),
            BankSpec("w13_scale", "w13_weight_scale", (2 * i, h // g), sdt),
            BankSpec("w2_scale", "w2_weight_scale", (h, i // g), sdt),
        )
        if self.name == "nvfp4":
            specs += (
                BankSpec("w13_scale_2", "w13_weight_scale_2", (2,), torch.float32),
                BankSpec("w2_scale_2", "w2_weight_scale_2", (), torch.float32),
            )
        if self.biases:
            specs += (
                BankSpec("w13_bias", "w13_weight_bias", (2 * i,), torch.bfloat16),
                BankSpec("w2_bias", "w2_weight_bias", (h,), torch.bfloat16),
            )
        return specs

    def expert_bytes(self, hidden_size: int, intermediate_size: int) -> int:
        """Bytes of one complete expert across its banks (weights + scales)."""
        return sum(
            math.prod(s.row_shape) * torch.empty((), dtype=s.dtype).element_size()
            for s in self.banks(hidden_size, intermediate_size)
        )

    def layer_tensors(self, layer) -> Dict[str, torch.Tensor]:
        """The layer's per-expert tensors of this format, by bank name.

        Found as upstream's paged experts finds them (``paged_experts.formats.expert_params``).

        Raises:
            ValueError: a tensor the format needs is not on the layer (names it and the
                layer's per-expert tensors).
        """
        from sglang.srt.layers.moe.paged_experts.formats import expert_params

        num = getattr(layer, "num_local_experts", None) or layer.w13_weight.shape[0]
        present = set(expert_params(layer, num))
        h = layer.w2_weight.shape[1]
        i = layer.w13_weight.shape[1] // 2
        out = {}
        for s in self.banks(h, i):
            if s.layer_param not in present:
                raise ValueError(
                    f"{self.name} experts need the layer parameter {s.layer_param}; the layer has "
                    f"{sorted(present)}"
                )
            out[s.name] = getattr(layer, s.layer_param).data
        return out

    def layer_row_shape(self, spec: BankSpec) -> Tuple[int, ...]:
        """The per-expert shape of ``spec``'s layer parameter as the quant method creates it:
        the bank's row shape, except a per-tensor format's scales (``(2,)`` for w13: gate,
        up; ``()`` for w2)."""
        if self.per_tensor and spec.name == "w13_scale":
            return (2,)
        if self.per_tensor and spec.name == "w2_scale":
            return ()
        return spec.row_shape

    def check_layer(self, layer, num_experts: int, hidden_size: int, intermediate_size: int):
        """Raise unless the per-expert tensors a quant method's ``create_weights`` put on
        ``layer`` (shapes and dtypes read from the parameters, which may be on the meta device)
        are exactly this format's banks (shapes: :meth:`layer_row_shape`) and its ``unread``
        parameters.

        Raises:
            ValueError: a tensor missing, extra, or of another shape or dtype; names them.
        """
        from sglang.srt.layers.moe.paged_experts.formats import expert_params

        specs = {s.layer_param: s for s in self.banks(hidden_size, intermediate_size)}
        names = expert_params(layer, num_experts)
        problems = [f"no {n}" for n in specs if n not in names]
        problems += [
            f"unexpected per-expert {n}" for n in names if n not in specs and n not in self.unread
        ]
        for n in set(names) & set(specs):
            p, s = getattr(layer, n), specs[n]
            want = self.layer_row_shape(s)
            if tuple(p.shape[1:]) != want or p.dtype != s.dtype:
                problems.append(
                    f"{n} is {p.dtype} {tuple(p.shape[1:])} per expert, not {s.dtype} {want}"
                )
        if problems:
            raise ValueError(
                f"--enable-expert-cache: the {self.label} method's per-expert tensors do not "
                f"match the {self.label} banks: {'; '.join(sorted(problems))}"
            )

    # ---- float64 references ------------------------------------------------------------
    def dequantize(self, t: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """float64 ``(w13 [..., 2I, H], w2 [..., H, I])`` of the banks ``t`` (bank names; any
        leading dimensions, e.g. ``[N]``): the exact values the format encodes."""
        if self.name == "fp8" and self.channel:  # scales [..., rows, 1]
            return (
                t["w13"].double() * t["w13_scale"].double(),
                t["w2"].double() * t["w2_scale"].double(),
            )
        if self.name == "fp8":
            return (
                _dequant_fp8(t["w13"], t["w13_scale"]),
                _dequant_fp8(t["w2"], t["w2_scale"]),
            )
        if self.name == "mxfp4":
            s13 = torch.exp2(t["w13_scale"].double() - 127)
            s2 = torch.exp2(t["w2_scale"].double() - 127)
            return _dequant_e2m1(t["w13"], s13, 32), _dequant_e2m1(t["w2"], s2, 32)
        g13 = t["w13_scale_2"].double()
        i = t["w13"].shape[-2] // 2
        if g13.shape[-1:] == (2,):  # (gate, up) per expert -> one per row
            g13 = g13.repeat_interleave(i, dim=-1)
        else:
            g13 = g13[..., None].expand(*g13.shape, 2 * i)
        s13 = t["w13_scale"].double() * g13[..., None]
        s2 = t["w2_scale"].double() * t["w2_scale_2"].double()[..., None, None]
        return _dequant_e2m1(t["w13"], s13, 16), _dequant_e2m1(t["w2"], s2, 16)

    # ---- quantizers (tests, benchmarks) -------------------------------------------------
    def quantize(self, w13: torch.Tensor, w2: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Banks of this format for float weights ``w13 [N, 2I, H]``, ``w2 [N, H, I]``, with the
        scales a checkpoint quantizer picks (amax of each block / group / row over the format's
        max; e8m0 scales rounded up; nvfp4 globals amax / (6 * 448) per matrix, gate and up
        apart)."""
        if self.name == "fp8" and self.channel:
            a, sa = _quant_fp8_channel(w13)
            b, sb = _quant_fp8_channel(w2)
            return {"w13": a, "w2": b, "w13_scale": sa, "w2_scale": sb}
        if self.name == "fp8":
            a, sa = _quant_fp8(w13)
            b, sb = _quant_fp8(w2)
            return {"w13": a, "w2": b, "w13_scale": sa, "w2_scale": sb}
        if self.name == "mxfp4":
            a, sa = _quant_mx(w13)
            b, sb = _quant_mx(w2)
            return {"w13": a, "w2": b, "w13_scale": sa, "w2_scale": sb}
        i = w13.shape[1] // 2
        gate_g = _nv_global(w13[:, :i])
        up_g = _nv_global(w13[:, i:])
        g2 = _nv_global(w2)
        rows_g = torch.cat([gate_g[:, None].expand(-1, i), up_g[:, None].expand(-1, i)], 1)
        a, sa = _quant_nv(w13, rows_g)
        b, sb = _quant_nv(w2, g2[:, None].expand(-1, w2.shape[1]))
        return {
            "w13": a,
            "w2": b,
            "w13_scale": sa,
            "w2_scale": sb,
            "w13_scale_2": torch.stack([gate_g, up_g], 1).contiguous(),
            "w2_scale_2": g2.contiguous(),
        }


def deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Gate/up rows of an interleaved w13 tensor into the executor's halves layout.

    gpt-oss checkpoints interleave the gate and up projections along the output rows (row
    ``2i`` is gate row ``i``, row ``2i + 1`` up row ``i``: transformers'
    ``GptOssExperts._apply_gate`` takes ``gate_up[..., ::2]`` and ``[..., 1::2]``); the CPU
    executor reads gate rows ``[0, I)`` then up rows ``[I, 2I)`` (SGLang's ``w13_weight``). This
    is the one place the layout changes: apply it, at load, to every per-row w13 tensor of such
    a checkpoint (packed weights ``[E, 2I, ...]``, their per-row scales, and the bias
    ``[E, 2I]``), never in a kernel. (Block-FP8 scales cover 128 rows each and cannot be
    de-interleaved; no interleaved FP8 checkpoint exists.)

    Args:
        t: ``[E, 2I, ...]`` tensor of any dtype (dim 1 the interleaved rows).

    Returns:
        A new contiguous ``[E, 2I, ...]`` tensor: ``out[:, :I] = t[:, 0::2]``,
        ``out[:, I:] = t[:, 1::2]``.

    Raises:
        ValueError: ``t`` has fewer than 2 dims or an odd dim 1.
    """
    if t.dim() < 2 or t.shape[1] % 2:
        raise ValueError(
            f"deinterleave_gate_up needs an [E, 2I, ...] tensor (even dim 1), got shape "
            f"{tuple(t.shape)}"
        )
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()


def executor_args(fmt: ExpertFormat, sets: Sequence[Dict[str, torch.Tensor]]) -> dict:
    """Keyword arguments of ``moe_experts_cpu`` for bank sets ``sets`` (bank name -> tensor):
    ``w13``, ``w2``, ``format``, the format's scale lists and the bias banks ``w13_bias``
    [rows, 2I] / ``w2_bias`` [rows, H] the sets hold."""
    name = getattr(fmt, "executor_format", "bf16")
    kw = dict(w13=[s["w13"] for s in sets], w2=[s["w2"] for s in sets], format=name)
    for key in ("w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2", "w13_bias", "w2_bias"):
        if sets and key in sets[0]:
            kw[key] = [s[key] for s in sets]
    return kw


FP8 = QuantExpertFormat(
    label="fp8 (block 128x128)", dtype=torch.float8_e4m3fn, name="fp8", group=128
)
MXFP4 = QuantExpertFormat(label="mxfp4", dtype=torch.uint8, name="mxfp4", group=32)
# gpt-oss as upstream's Mxfp4MoEMethod holds it: mxfp4 plus the bias banks.
MXFP4_BIASED = QuantExpertFormat(
    label="mxfp4", dtype=torch.uint8, name="mxfp4", group=32, biases=True
)
NVFP4 = QuantExpertFormat(label="nvfp4", dtype=torch.uint8, name="nvfp4", group=16)
# compressed-tensors FP8 (llm-compressor's FP8-Dynamic / FP8_BLOCK), as
# CompressedTensorsW8A8Fp8MoE creates it: the executor's fp8 format with its scale layouts.
CT_FP8_CHANNEL = QuantExpertFormat(
    label="ct-fp8 (per channel)",
    dtype=torch.float8_e4m3fn,
    name="fp8",
    group=128,
    channel=True,
    scale_param="weight_scale",
)
CT_FP8_BLOCK = QuantExpertFormat(
    label="ct-fp8 (block 128x128)",
    dtype=torch.float8_e4m3fn,
    name="fp8",
    group=128,
    scale_param="weight_scale",
)
# llm-compressor's static per-tensor "FP8" scheme (RedHatAI/Mixtral-8x7B-Instruct-v0.1-FP8):
# one scale per projection, held per output channel so the executor's fp8 format reads it as
# CT_FP8_CHANNEL (4 bytes a row: 14 KB beside a 4.7 MB Qwen3-30B-A3B expert); the static input
# scales stay on the layer, unread (the activations stay bf16).
CT_FP8_TENSOR = QuantExpertFormat(
    label="ct-fp8 (per tensor)",
    dtype=torch.float8_e4m3fn,
    name="fp8",
    group=128,
    channel=True,
    scale_param="weight_scale",
    per_tensor=True,
    unread=("w13_input_scale", "w2_input_scale"),
)
# By key (tests, benchmarks); ``executor_format`` is the executor's format name.
QUANT_FORMATS = {"fp8": FP8, "mxfp4": MXFP4, "nvfp4": NVFP4, "fp8-channel": CT_FP8_CHANNEL}


# ---- helpers ------------------------------------------------------------------------------
def _expand_blocks(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[..., ceil(rows/128), ceil(cols/128)] block scales -> [..., rows, cols]."""
    s = s.repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)
    return s[..., :rows, :cols]


def _dequant_fp8(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return w.double() * _expand_blocks(s.double(), w.shape[-2], w.shape[-1])


def _e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> codes [..., n] (element 2j from the low nibble)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def _dequant_e2m1(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    codes = _e2m1_codes(packed).long()
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    v = lut[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    return v * scale.repeat_interleave(group, dim=-1)


def _quant_fp8(w: torch.Tensor):
    *lead, r, c = w.shape
    rb, cb = math.ceil(r / FP8_BLOCK), math.ceil(c / FP8_BLOCK)
    pad = torch.zeros(*lead, rb * FP8_BLOCK, cb * FP8_BLOCK, dtype=torch.float32)
    pad[..., :r, :c] = w.float()
    blocks = pad.view(*lead, rb, FP8_BLOCK, cb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    scale = (amax / FP8_MAX).float()
    q = w.float() / _expand_blocks(scale, r, c)
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def _quant_fp8_channel(w: torch.Tensor):
    """[..., rows, cols] -> (fp8 [..., rows, cols], float32 scales [..., rows, 1] = amax of the
    row / 448; an all-zero row gets 1)."""
    amax = w.float().abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def _e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code of x (|x| <= 6); a tie goes to the lower code (argmin keeps the first),
    e.g. 0.75 -> 0.5. Test weights only need some valid code: dequantization is exact."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    mag = (x.abs()[..., None] - lut).abs().argmin(-1)
    return (mag | torch.where(x < 0, 8, 0)).to(torch.uint8)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def _quant_mx(w: torch.Tensor):
    g = w.float().unflatten(-1, (-1, 32))
    amax = g.abs().amax(-1).clamp(min=2.0**-120)
    e = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-127, 127)
    codes = _e2m1_encode(g / torch.exp2(e)[..., None]).flatten(-2)
    return _pack(codes), (e + 127).to(torch.uint8).contiguous()


def _nv_global(w: torch.Tensor) -> torch.Tensor:
    return (w.float().abs().flatten(1).amax(1).clamp(min=1e-12) / (E2M1_MAX * FP8_MAX)).float()


def _quant_nv(w: torch.Tensor, row_global: torch.Tensor):
    g = w.float().unflatten(-1, (-1, 16))
    amax = g.abs().amax(-1)
    scale = (amax / E2M1_MAX / row_global[..., None]).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    eff = scale.float() * row_global[..., None]
    q = g / torch.where(eff > 0, eff, 1.0)[..., None]
    codes = _e2m1_encode(q.clamp(-E2M1_MAX, E2M1_MAX)).flatten(-2)
    return _pack(codes), scale.contiguous()
