"""Semantic-anchor markers: which strings mark block boundaries, and where they sit in a prompt.

An anchor is a token position just before or just after a marker: a special token or
chat-template tag that opens or closes thinking, a tool call, a tool output or a turn
(``<think>``, ``</tool_call>``, ``<|im_start|>`` ...). Agent harnesses edit history a whole block
at a time, so the prefix an edited prompt still shares with the cached one ends at such a
position (paper §3.1, "semantic anchors").

Markers are strings, not token ids: a marker may be one special token or several plain tokens
(``<tool_response>`` in a tokenizer without that special token). :class:`AnchorScanner` finds them
in the bytes of a token span and maps each occurrence back to token boundaries. A boundary is
always the LAST token boundary at or before the marker's start (before-anchor) or end
(after-anchor), so an anchor never lies past the point where an edit right at the marker would
make the token sequences differ, however the tokenizer merged the marker with its neighbours.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence

import numpy as np

# Tag-like literals of chat templates: <|im_start|>, <|start_header_id|>, <think>, </tool_call>.
_TAG_RE = re.compile(r"<\|[^|<>\s]{1,40}\|>|</?[A-Za-z_][A-Za-z0-9_\-]{0,39}>")
# Added tokens whose text is a bracketed keyword ([INST], [TOOL_CALLS]) also mark blocks.
_BRACKET_RE = re.compile(r"^\[/?[A-Z_]{2,40}\]$")


def derive_markers(added_token_texts: Iterable[str], chat_template: Optional[str]) -> list[str]:
    """The default marker set of a tokenizer and its chat template.

    Every tag-like literal of the chat template (``<|im_start|>``, ``</think>``, ``<tools>``), plus
    every added token of the tokenizer whose text occurs verbatim in the template (``[INST]``).
    Markers of the template that the tokenizer splits into several tokens are kept: the scanner
    matches text, not ids. Without a template, the added tokens that look like tags.

    Returns:
        Sorted, de-duplicated marker strings.
    """
    template = chat_template or ""
    found = set(_TAG_RE.findall(template))
    for text in added_token_texts:
        if not text or text.isspace():
            continue
        if template:
            if text in template:
                found.add(text)
        elif _TAG_RE.fullmatch(text) or _BRACKET_RE.match(text):
            found.add(text)
    return sorted(found)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}
_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _piece_bytes_byte_level(piece: str) -> bytes:
    out = bytearray()
    for ch in piece:
        b = _BYTE_OF_CHAR.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def _piece_bytes_sentencepiece(piece: str) -> bytes:
    m = _SP_BYTE.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def token_bytes_table(tokenizer) -> list[bytes]:
    """Bytes of every token id of a Hugging Face tokenizer (added tokens: their text).

    Byte-level BPE and SentencePiece vocabularies are mapped piece by piece; the mapping is
    accepted only if it round-trips a probe text, otherwise each id is decoded alone (slower,
    still exact for the ASCII markers).
    """
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    probe = "Hello world,\n\tfoo_bar(1) <x> ünï"
    probe_ids = tokenizer.encode(probe, add_special_tokens=False)
    for convert in (_piece_bytes_byte_level, _piece_bytes_sentencepiece):
        table = [
            added[i].encode("utf-8") if i in added else (convert(p) if p is not None else b"")
            for i, p in enumerate(pieces)
        ]
        got = b"".join(table[i] for i in probe_ids)
        if got in (probe.encode("utf-8"), b" " + probe.encode("utf-8")):
            return table
    return [tokenizer.decode([i]).encode("utf-8") for i in range(size)]


def _holds_any(table: Sequence[bytes], byte_values: set[int]) -> np.ndarray:
    """Bool per entry of ``table``: does it contain any of ``byte_values``."""
    others = bytes(b for b in range(256) if b not in byte_values)
    return np.fromiter(
        (bool(t.translate(None, others)) for t in table), dtype=bool, count=len(table)
    )


class AnchorScanner:
    """Finds anchor positions of a marker set in token sequences.

    ``table`` holds the bytes of each token id; ``markers`` the marker strings. Positions are
    prefix lengths: anchor ``p`` names the state after the first ``p`` tokens.
    """

    def __init__(self, markers: Sequence[str], table: Sequence[bytes]) -> None:
        self.markers: tuple[str, ...] = tuple(markers)
        self.table: tuple[bytes, ...] = tuple(table)
        pats = sorted({m.encode("utf-8") for m in self.markers if m}, key=len, reverse=True)
        self._re = re.compile(b"|".join(map(re.escape, pats))) if pats else None
        self._lens = np.fromiter(
            (len(b) for b in self.table), dtype=np.int64, count=len(self.table)
        )
        # A marker of n bytes covers at most n tokens: the look-back that finds a marker
        # straddling the start of a scanned span.
        self.lookback: int = max((len(p) for p in pats), default=0)
        # Per token id: do its bytes hold the first byte of some marker (a before-anchor may sit
        # at its start) / the last byte of some marker (an after-anchor may sit at its end)?
        # The cheap test decode runs on every generated token before it scans.
        self._may_open = _holds_any(self.table, {p[0] for p in pats})
        self._may_close = _holds_any(self.table, {p[-1] for p in pats})

    @classmethod
    def from_tokenizer(
        cls, tokenizer, markers: Optional[Sequence[str]] = None, chat_template: Optional[str] = None
    ) -> "AnchorScanner":
        """Scanner for ``markers`` (default: :func:`derive_markers` of the tokenizer and template)."""
        if markers is None:
            added = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
            template = (
                chat_template
                if chat_template is not None
                else getattr(tokenizer, "chat_template", None)
            )
            if isinstance(template, dict):  # named templates
                template = "\n".join(str(v) for v in template.values())
            markers = derive_markers(added, template)
        return cls(tuple(markers), tuple(token_bytes_table(tokenizer)))

    def may_anchor_between(self, prev: int, cur: int) -> bool:
        """Whether an anchor can lie at the boundary between tokens ``prev`` and ``cur`` (ids):
        False means certainly not; True means :meth:`scan` must tell. O(1)."""
        n = len(self.table)
        return bool(
            (0 <= cur < n and (self._may_open[cur] or self._may_close[cur]))
            or (0 <= prev < n and self._may_close[prev])
        )

    def scan(self, ids: Sequence[int], start: int = 0, end: Optional[int] = None) -> np.ndarray:
        """Sorted anchor positions ``p`` with ``start <= p <= end`` in ``ids``.

        Tokens from ``start - lookback`` are read, so a marker that begins before ``start``
        still yields its after-anchor inside the range.
        """
        end = len(ids) if end is None else min(end, len(ids))
        if self._re is None or end <= start:
            return np.empty(0, dtype=np.int64)
        lo = max(0, start - self.lookback)
        window = np.asarray(ids[lo:end], dtype=np.int64)
        n = len(self.table)
        inside = window < n
        lens = np.where(inside, self._lens[np.where(inside, window, 0)], 0)
        bounds = np.zeros(len(window) + 1, dtype=np.int64)
        np.cumsum(lens, out=bounds[1:])
        table = self.table
        text = b"".join(table[i] if 0 <= i < n else b"" for i in window.tolist())
        edges = []
        for m in self._re.finditer(text):
            edges.append(m.start())
            edges.append(m.end())
        if not edges:
            return np.empty(0, dtype=np.int64)
        # The last token boundary at or before each byte offset.
        pos = np.searchsorted(bounds, np.asarray(edges, dtype=np.int64), side="right") - 1 + lo
        pos = np.unique(pos)
        return pos[(pos >= start) & (pos <= end)]
