"""Deterministic byte-level BPE tokenizer for the tiny test models.

The tokenizer is trained locally with the ``tokenizers`` library on a corpus that every machine
of this project has byte-for-byte: the sorted ``*.py`` source files of the installed, pinned
``transformers`` package (every ``CORPUS_STRIDE``-th file). No network, no downloaded
vocabulary, nothing tuned on the agent traces. The pipeline matches Qwen2/Qwen3's tokenizer
(NFC normalizer, Qwen's split regex, byte-level pre-tokenizer and decoder, no BOS), so
``Qwen2Tokenizer`` in transformers loads it unchanged.

Qwen's chat/control tokens are appended after training as single added tokens:
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` are special (dropped by
``skip_special_tokens=True``); ``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``,
``<tool_response>``, ``</tool_response>`` are non-special added tokens, as in Qwen3, so they
survive detokenization and reach SGLang's reasoning and tool-call parsers.

Training takes a few seconds; the result is cached on disk (see ``cache_dir``) and in memory,
keyed by everything that determines it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

logger = logging.getLogger(__name__)

# Bump when anything below changes the trained tokenizer.
TOKENIZER_RECIPE_VERSION = 1

VOCAB_SIZE = 32768  # total, including the added tokens below
CORPUS_PACKAGE = "transformers"
CORPUS_PACKAGE_PINNED_VERSION = "5.19.0"
CORPUS_STRIDE = 2  # every 2nd file of the sorted list (~1360 files, ~24 MB)

# Same split regex as Qwen2/Qwen3 (transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# (content, special) in id order; ids are VOCAB_SIZE - len(ADDED_TOKENS) ... VOCAB_SIZE - 1.
ADDED_TOKENS: List[Tuple[str, bool]] = [
    (ENDOFTEXT, True),
    (IM_START, True),
    (IM_END, True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

_MEMORY_CACHE: Dict[str, str] = {}


def corpus_files() -> Tuple[str, List[Path]]:
    """(package version, files) of the training corpus, in training order."""
    import importlib.metadata

    import transformers

    version = importlib.metadata.version(CORPUS_PACKAGE)
    root = Path(transformers.__file__).resolve().parent
    files = sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())
    return version, files[::CORPUS_STRIDE]


def _cache_key(version: str) -> str:
    import tokenizers

    spec = {
        "recipe": TOKENIZER_RECIPE_VERSION,
        "vocab_size": VOCAB_SIZE,
        "corpus": f"{CORPUS_PACKAGE}=={version}",
        "stride": CORPUS_STRIDE,
        "regex": PRETOKENIZE_REGEX,
        "added": ADDED_TOKENS,
        "tokenizers": tokenizers.__version__,
        # any edit of this file invalidates the cache, even without a version bump
        "source": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    env = os.environ.get("SGLANG_TINY_MODELS_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sglang_tiny_models"


def train_tokenizer_json() -> str:
    """Train the tokenizer from scratch; returns the tokenizer.json text (deterministic)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    version, files = corpus_files()
    if version != CORPUS_PACKAGE_PINNED_VERSION:
        logger.warning(
            "tiny_models tokenizer corpus is %s==%s, not the pinned %s: the vocabulary will "
            "differ from other machines of the project",
            CORPUS_PACKAGE,
            version,
            CORPUS_PACKAGE_PINNED_VERSION,
        )

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )

    def texts():
        for path in files:
            yield path.read_text(encoding="utf-8", errors="replace")

    tok.train_from_iterator(texts(), trainer=trainer, length=len(files))
    if tok.get_vocab_size() != VOCAB_SIZE - len(ADDED_TOKENS):
        raise RuntimeError(
            f"BPE training produced {tok.get_vocab_size()} tokens, expected "
            f"{VOCAB_SIZE - len(ADDED_TOKENS)}"
        )
    for content, special in ADDED_TOKENS:
        tok.add_tokens(
            [
                AddedToken(
                    content,
                    special=special,
                    normalized=False,
                    single_word=False,
                    lstrip=False,
                    rstrip=False,
                )
            ]
        )
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    # Canonical, byte-stable serialization.
    return (
        json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=2, sort_keys=False) + "\n"
    )


def tokenizer_json(use_cache: bool = True) -> str:
    """tokenizer.json text, from the in-memory / on-disk cache when possible."""
    version, _ = corpus_files()
    key = _cache_key(version)
    if use_cache and key in _MEMORY_CACHE:
        return _MEMORY_CACHE[key]
    path = cache_dir() / f"tokenizer-{key}.json"
    if use_cache:
        try:
            text = path.read_text(encoding="utf-8")
            json.loads(text)  # a torn or corrupt file is retrained
            _MEMORY_CACHE[key] = text
            return text
        except (OSError, ValueError):
            pass
    text = train_tokenizer_json()
    _MEMORY_CACHE[key] = text
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tok-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except OSError as e:  # read-only home etc.: just skip the disk cache
            logger.debug("could not write tokenizer cache %s: %s", path, e)
    return text


def added_token_ids() -> Dict[str, int]:
    first = VOCAB_SIZE - len(ADDED_TOKENS)
    return {content: first + i for i, (content, _) in enumerate(ADDED_TOKENS)}


def chat_template() -> str:
    return (Path(__file__).resolve().parent / "chat_template.jinja").read_text(encoding="utf-8")


def tokenizer_config(model_max_length: int) -> dict:
    ids = added_token_ids()
    decoder = {
        str(ids[content]): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, special in ADDED_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer(out_dir: Path, model_max_length: int, use_cache: bool = True) -> None:
    out_dir = Path(out_dir)
    (out_dir / "tokenizer.json").write_text(tokenizer_json(use_cache), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )
