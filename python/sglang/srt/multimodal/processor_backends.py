"""Whether a vision-language checkpoint's processor can be built in this environment.

A vision-language checkpoint (Qwen3.5 and Qwen3-VL, for example) ships
``preprocessor_config.json`` and ``video_preprocessor_config.json``; the server builds
transformers' ``AutoProcessor`` from them in the tokenizer manager and the scheduler. In
transformers 5 the video processors and the ``*Fast`` image processors need torchvision, and on
a CPU-only machine the registry's torchvision is a CUDA build that does not import beside CPU
torch (patch 0001), so it is usually absent there. Without this check such a checkpoint does
not start at all (``Qwen3VLVideoProcessor requires the Torchvision library``), although its
language model serves text fine: the model config turns multimodal off for it instead (patch
0080), with a warning, as upstream already does for the models it lists in
``configs/model_config.py`` (``mm_disabled_models``); image and video requests are then
refused by the serving layer as for any text model.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Optional

VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"


def torchvision_available() -> bool:
    """True when a ``torchvision`` package is installed (found, not imported: importing a
    CUDA build beside CPU torch fails and leaves torch's op registry half written)."""
    return importlib.util.find_spec("torchvision") is not None


def _processor_class_needs_torchvision(model_dir: Path) -> Optional[str]:
    """``"model type 'T' (Processor)"`` when the processor class that transformers maps the
    checkpoint's ``model_type`` to imports torchvision at import time (Gemma 4's
    ``Gemma4Processor``), or None.

    Only called when torchvision is not installed, so the import fails at once and cleanly."""
    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    if not name:
        return None
    import transformers

    try:
        getattr(transformers, name)
    except ImportError as e:
        missing = {(getattr(err, "name", None) or "").split(".")[0] for err in (e, e.__cause__)}
        if "torchvision" in missing:  # transformers re-raises it with the class's name
            return f"model type {model_type!r} ({name})"
    return None


def processor_needs_torchvision(model_dir: Path) -> Optional[str]:
    """What of ``model_dir`` transformers builds on torchvision, or None: a video processor
    config, an image processor config naming a ``*Fast`` processor, or the model type's
    processor class whose module imports torchvision (``config.json``'s ``model_type``, as
    ``AutoProcessor`` maps it)."""
    if (model_dir / VIDEO_PROCESSOR_FILE).is_file():
        return VIDEO_PROCESSOR_FILE
    image = model_dir / IMAGE_PROCESSOR_FILE
    if image.is_file():
        try:
            kind = json.loads(image.read_text()).get("image_processor_type") or ""
        except (OSError, ValueError, AttributeError):
            return None  # unreadable: let transformers report it as it would
        if kind.endswith("Fast"):
            return f"{IMAGE_PROCESSOR_FILE} ({kind})"
    if (cls := _processor_class_needs_torchvision(model_dir)) is not None:
        return cls
    return None


def text_only_reason(model_path: str) -> Optional[str]:
    """Why the checkpoint at ``model_path`` must be served text-only here, or None.

    ``model_path`` is a local folder or a hub id; for a hub id (no local folder) nothing is
    decided here and a missing backend surfaces as transformers reports it.
    """
    model_dir = Path(model_path)
    if not model_dir.is_dir() or torchvision_available():
        return None
    needs = processor_needs_torchvision(model_dir)
    if needs is None:
        return None
    return (
        f"Multimodal is disabled for {model_dir.name}: the processor of its {needs} needs "
        "torchvision, which is not installed (the registry's build is for CUDA torch). Serving "
        "text only; image and video requests are refused. Install the torchvision build that "
        "matches your torch to serve them, or pass --enable-multimodal to fail at startup instead."
    )
