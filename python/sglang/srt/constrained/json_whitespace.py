"""A bound on the whitespace a structural tag's JSON content may hold.

Upstream's ``XGrammarGrammarBackend`` honours ``--constrained-json-disable-any-whitespace`` and
``--constrained-json-max-whitespace-cnt`` when it compiles a JSON schema (``response_format``,
the ``json_schema`` constraint of a forced call), but compiles structural tags (the tool-call
grammar of most parsers) with neither, so a model can pad a tool call's arguments with
whitespace until ``max_tokens`` runs out. Patch ``0028-structural-tag-json-whitespace`` calls
:func:`bound_structural_tag_whitespace` on every structural tag before it is compiled.

XGrammar's structural-tag JSON content has a per-content ``max_whitespace_cnt`` (at most that
many consecutive whitespace characters between JSON tokens; at least 1) and no compact mode, so
``--constrained-json-disable-any-whitespace`` is the closest it can do: one character.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["DEFAULT_MAX_WHITESPACE", "bound_structural_tag_whitespace", "whitespace_bound"]

# Without a flag: room for pretty-printed JSON (a newline and 2-space indents to depth 7), not
# for padding without end.
DEFAULT_MAX_WHITESPACE = 16

# Structural-tag formats that hold other formats: the key of one child, or of a list of them
# (xgrammar.structural_tag).
_CHILD = {"structural_tag": "format", "tag": "content"}
_CHILDREN = {
    "sequence": "elements",
    "or": "elements",
    "triggered_tags": "tags",
    "tags_with_separator": "tags",
}


def whitespace_bound(disable_any_whitespace: bool, max_whitespace_cnt: Optional[int]) -> int:
    """The most consecutive whitespace characters a structural tag's JSON may hold.

    Args:
        disable_any_whitespace: ``--constrained-json-disable-any-whitespace``: 1 (XGrammar's
            smallest bound for structural tags).
        max_whitespace_cnt: ``--constrained-json-max-whitespace-cnt``, used when set (and
            smaller than 1 is raised to 1); None: :data:`DEFAULT_MAX_WHITESPACE`.
    """
    if disable_any_whitespace:
        return 1
    if max_whitespace_cnt is not None:
        return max(1, int(max_whitespace_cnt))
    return DEFAULT_MAX_WHITESPACE


def bound_structural_tag_whitespace(fmt: Any, bound: int) -> Any:
    """Set ``max_whitespace_cnt = bound`` on every ``json_schema`` format in ``fmt`` that has
    none, descending through ``tag``, ``sequence``, ``or``, ``triggered_tags`` and
    ``tags_with_separator``. ``fmt`` is a structural tag's ``format`` dict (or the whole
    ``{"type": "structural_tag", "format": ...}``); it is changed in place and returned.
    A bound the client set on a format is kept. Anything that is not a dict is returned as is.
    """
    if not isinstance(fmt, dict):
        return fmt
    kind = fmt.get("type")
    if kind == "json_schema" and fmt.get("max_whitespace_cnt") is None:
        fmt["max_whitespace_cnt"] = bound
    elif kind in _CHILD:
        bound_structural_tag_whitespace(fmt.get(_CHILD[kind]), bound)
    elif kind in _CHILDREN:
        for child in fmt.get(_CHILDREN[kind]) or []:
            bound_structural_tag_whitespace(child, bound)
    return fmt
