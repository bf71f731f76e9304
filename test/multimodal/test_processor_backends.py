"""sglang.srt.multimodal.processor_backends: when a checkpoint's processor needs torchvision."""

import json

import pytest

from sglang.srt.multimodal import processor_backends as pb


@pytest.fixture
def no_torchvision(monkeypatch):
    monkeypatch.setattr(pb, "torchvision_available", lambda: False)


def _write(d, name, obj):
    (d / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))


def test_text_model_and_hub_id_are_left_alone(tmp_path, no_torchvision):
    _write(tmp_path, "config.json", {})
    assert pb.text_only_reason(str(tmp_path)) is None
    assert pb.text_only_reason("Qwen/Qwen3.5-35B-A3B") is None  # not a local folder


def test_video_processor_needs_torchvision(tmp_path, no_torchvision):
    _write(tmp_path, pb.VIDEO_PROCESSOR_FILE, {"video_processor_type": "Qwen3VLVideoProcessor"})
    reason = pb.text_only_reason(str(tmp_path))
    assert reason.startswith(f"Multimodal is disabled for {tmp_path.name}")
    assert "--enable-multimodal" in reason


@pytest.mark.parametrize(
    "kind,needs", [("Qwen2VLImageProcessorFast", True), ("Qwen2VLImageProcessor", False)]
)
def test_fast_image_processor_needs_torchvision(tmp_path, no_torchvision, kind, needs):
    _write(tmp_path, pb.IMAGE_PROCESSOR_FILE, {"image_processor_type": kind})
    assert (pb.text_only_reason(str(tmp_path)) is not None) == needs


def test_unreadable_config_is_left_to_transformers(tmp_path, no_torchvision):
    _write(tmp_path, pb.IMAGE_PROCESSOR_FILE, "{not json")
    assert pb.text_only_reason(str(tmp_path)) is None


def test_installed_torchvision_keeps_multimodal(tmp_path, monkeypatch):
    monkeypatch.setattr(pb, "torchvision_available", lambda: True)
    _write(tmp_path, pb.VIDEO_PROCESSOR_FILE, {})
    assert pb.text_only_reason(str(tmp_path)) is None


def test_processor_class_importing_torchvision(tmp_path, no_torchvision):
    """Gemma 4 ships no video processor config, but transformers' ``Gemma4Processor`` module
    imports torchvision: the model type decides (a text model type has no processor class)."""
    pytest.importorskip("transformers")
    if pb.importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the processor imports")
    _write(tmp_path, "config.json", {"model_type": "gemma4"})
    assert "model type 'gemma4' (Gemma4Processor)" in pb.text_only_reason(str(tmp_path))
    _write(tmp_path, "config.json", {"model_type": "qwen3_moe"})
    assert pb.text_only_reason(str(tmp_path)) is None
