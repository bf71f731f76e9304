"""Semantic-anchor recurrent-state checkpoints for hybrid (linear + full attention) models.

Paper §3.1, "Semantic anchors preserve recurrent state across context edits": agent harnesses
edit history a whole block at a time (thinking, tool call, tool output, turn), so the prefix an
edited prompt still shares ends at a special-token boundary. Prefill chunks are ended at those
boundaries (:mod:`.planner`), so upstream's hybrid radix cache stores the exact recurrent state
there; a later prompt restores from the deepest anchor it still shares and prefills only the
rest. Markers come from the tokenizer and chat template (:mod:`.markers`); the cache subclass
tags the stored states and exports their counters (:mod:`.cache`, :mod:`.stats`).

Flags (``exec.mamba``): ``--disable-anchor-checkpoints``, ``--anchor-markers``,
``--anchor-checkpoint-min-gap``, ``--anchor-checkpoint-max-states``.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from sglang.srt.mem_cache.anchor_checkpoints.markers import AnchorScanner, derive_markers

if TYPE_CHECKING:
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)

__all__ = [
    "ANCHOR_MODES",
    "AnchorScanner",
    "anchor_cache_factory",
    "derive_markers",
    "want_no_buffer_strategy",
]

# --anchor-checkpoint-mode: cut ends prefill chunks at anchors (a pass ends there); emit lets
# the chunks end where upstream ends them and writes the states inside the pass (emit.py);
# auto (the default) is emit where a kernel writes them (the CPU op; on CUDA the Triton chunk
# kernel, patch 0048), otherwise cut.
ANCHOR_MODES = ("auto", "cut", "emit")


def want_no_buffer_strategy(view) -> bool:
    """Whether upstream's ``--mamba-radix-cache-strategy auto`` should resolve to ``no_buffer``
    for anchor checkpoints (patch 0044, ``_mamba_radix_cache_resolution``), where it would pick
    ``extra_buffer`` only to keep the overlap scheduler. No_buffer is the one strategy that
    stores recurrent states at arbitrary positions; it is wanted when anchors are on and would
    run: none of speculative decoding (needs the extra buffer), the hierarchical cache, chunked
    prefill off, ``--skip-tokenizer-init`` (each turns anchors off in
    :func:`anchor_cache_factory`), PD disaggregation, ReplaySSM, ``trtllm_mha`` or a Blackwell
    (SM100) GPU, whose default attention backend for these models needs pages of 64 and is
    chosen after the strategy.

    Args:
        view: upstream's resolving view of the server args (fields read by name).
    """
    from sglang.srt.runtime_context import get_platform

    chunked = view.chunked_prefill_size
    return (
        not view.disable_anchor_checkpoints
        and view.speculative_algorithm is None
        and not view.enable_hierarchical_cache
        and (chunked is None or chunked > 0)
        and not view.skip_tokenizer_init
        and view.disaggregation_mode == "null"
        and not view.enable_linear_replayssm
        and view.attention_backend != "trtllm_mha"
        and not get_platform().is_sm100
    )


def _chat_template(server_args, tokenizer) -> Optional[str]:
    path = getattr(server_args, "chat_template", None)
    if path and Path(str(path)).is_file():
        return Path(str(path)).read_text(encoding="utf-8")
    return getattr(tokenizer, "chat_template", None)


def anchor_cache_factory(ctx: TreeCacheBuildContext) -> Optional[Callable]:
    """A constructor ``params -> AnchorRadixCache`` when anchors apply to this server, else None
    (anchors off, attention-only model, radix cache off, extra-buffer strategy, page size > 1,
    chunked prefill off, hierarchical cache, no tokenizer or one without a readable vocabulary).

    Raises:
        ValueError: ``--anchor-checkpoint-min-gap`` below 1, ``--anchor-checkpoint-max-states``
            0 or below -1, or an ``--anchor-checkpoint-mode`` other than auto / cut / emit.
    """
    from sglang.srt.runtime_context import get_exec

    mamba = get_exec().mamba
    if mamba.disable_anchor_checkpoints or not ctx.is_hybrid_ssm or ctx.disable_radix_cache:
        return None
    if mamba.anchor_checkpoint_min_gap < 1:
        raise ValueError(
            f"--anchor-checkpoint-min-gap must be at least 1, got {mamba.anchor_checkpoint_min_gap}"
        )
    if mamba.anchor_checkpoint_max_states == 0 or mamba.anchor_checkpoint_max_states < -1:
        raise ValueError(
            "--anchor-checkpoint-max-states must be -1 (no cap) or a positive number, got "
            f"{mamba.anchor_checkpoint_max_states}"
        )
    mode = getattr(mamba, "anchor_checkpoint_mode", "auto")
    if mode not in ANCHOR_MODES:
        raise ValueError(f"--anchor-checkpoint-mode must be one of {ANCHOR_MODES}, got {mode!r}")
    why_no_emit = _why_no_emit() if mode in ("auto", "emit") else None
    emit = mode in ("auto", "emit") and why_no_emit is None
    if mode == "emit" and not emit:
        logger.warning(
            "Anchor checkpoints: --anchor-checkpoint-mode emit needs %s; cutting prefill chunks "
            "instead.",
            why_no_emit,
        )
    elif mode == "auto" and not emit:
        logger.info(
            "Anchor checkpoints: cutting prefill chunks at anchors (--anchor-checkpoint-mode "
            "auto: writing the states inside the pass needs %s).",
            why_no_emit,
        )
    why_not = None
    from sglang.srt.runtime_context import get_schedule

    chunked = get_schedule().chunked_prefill_size  # what the scheduler uses (init_chunked_prefill)
    if ctx.params.enable_mamba_extra_buffer:
        why_not = (
            "the extra_buffer mamba radix cache strategy (it stores states on a fixed "
            "grid; --mamba-radix-cache-strategy no_buffer, with page size 1 and no "
            "speculative decoding, turns anchors on)"
        )
    elif ctx.params.page_size != 1:
        why_not = f"page size {ctx.params.page_size}"
    elif chunked is None or chunked <= 0:
        why_not = "chunked prefill off (--chunked-prefill-size -1); anchors end chunks early"
    elif ctx.enable_hierarchical_cache:
        why_not = "the hierarchical cache (--enable-hierarchical-cache)"
    tokenizer = getattr(ctx.tp_worker, "tokenizer", None)
    if why_not is None and tokenizer is None:
        why_not = "no tokenizer in the scheduler (--skip-tokenizer-init)"
    if why_not is not None:
        logger.warning("Anchor checkpoints are off: not supported with %s.", why_not)
        return None
    try:
        scanner = AnchorScanner.from_tokenizer(
            tokenizer,
            markers=mamba.anchor_markers,
            chat_template=_chat_template(ctx.server_args, tokenizer),
        )
    except Exception as e:  # a tokenizer without the Hugging Face vocabulary API
        logger.warning(
            "Anchor checkpoints are off: cannot read the tokenizer's vocabulary (%r).", e
        )
        return None
    if not scanner.markers:
        logger.warning("Anchor checkpoints are off: no markers in the tokenizer or chat template.")
        return None
    from sglang.srt.mem_cache.anchor_checkpoints.cache import AnchorRadixCache

    return functools.partial(
        AnchorRadixCache,
        scanner=scanner,
        min_gap=mamba.anchor_checkpoint_min_gap,
        max_states=mamba.anchor_checkpoint_max_states,
        emit=emit,
        emit_explicit=emit and mode == "emit",
    )


def _why_no_emit() -> Optional[str]:
    """None when a gated-DeltaNet prefill kernel here writes states inside the pass: the CPU op
    (``chunk_gated_delta_rule_cpu``), or on CUDA upstream's Triton chunk kernel (patch 0048) when
    the prefill backend is Triton (``--linear-attn-backend`` / ``--linear-attn-prefill-backend``);
    else what is missing. A pass whose layers still write nothing (linear layers other than gated
    DeltaNet, a kernel chosen later, a gathered strided state pool) turns cutting back on at run
    time (:meth:`.cache.AnchorRadixCache.insert_emitted_states`)."""
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.utils import is_cpu, is_cuda

    if is_cpu():
        return None
    if not is_cuda():
        return "the CPU gated-DeltaNet op or CUDA's Triton chunk kernel (this is neither)"
    mamba = get_exec().mamba
    prefill = getattr(mamba, "linear_attn_prefill_backend", None) or getattr(
        mamba, "linear_attn_backend", "triton"
    )
    if prefill != "triton":
        return f"the Triton GDN prefill kernel (--linear-attn-prefill-backend is {prefill})"
    return None
