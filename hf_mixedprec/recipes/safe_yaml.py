"""Bounded, strict YAML for recipes: plain data only, refused before it can cost time or memory.

``yaml.safe_load`` runs no code, but it still expands aliases (a few hundred bytes of nested ``*a`` references
become gigabytes), recurses once per nesting level (deep nesting ends in ``RecursionError``) and keeps the last
of two equal keys without a word. A recipe needs none of that, so :func:`load_recipe_yaml` refuses:

- input over :data:`MAX_BYTES` (checked before reading a file, see :func:`read_recipe_text`);
- anchors and aliases (``&name`` / ``*name``) and merge keys (``<<``), which need them;
- nesting deeper than :data:`MAX_DEPTH`;
- a key given twice in one mapping (both lines are named).

Every refusal is a :class:`YAMLRefusal` with one line that says what and where.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from hf_mixedprec.core._text import shown

__all__ = ["MAX_BYTES", "MAX_DEPTH", "YAMLRefusal", "load_recipe_yaml", "read_recipe_text"]

#: Largest recipe accepted, in bytes. The shipped recipes are under 2 KiB; this leaves room for comments.
MAX_BYTES = 256 * 1024
#: Deepest nesting accepted. The schema's deepest key (``health.detectors.NAME.threshold``) is 4 levels.
MAX_DEPTH = 16


class YAMLRefusal(ValueError):
    """The text is not acceptable recipe YAML; the message is one line."""


def read_recipe_text(path: str | os.PathLike[str]) -> str:
    """A recipe file's text, refused before reading when it is over :data:`MAX_BYTES` or not UTF-8."""
    p = Path(path)
    size = p.stat().st_size
    if size > MAX_BYTES:
        raise YAMLRefusal(f"{size} bytes is over the {MAX_BYTES}-byte limit for a recipe")
    with p.open("rb") as fh:
        data = fh.read(MAX_BYTES + 1)  # the file may grow between stat and read
    if len(data) > MAX_BYTES:
        raise YAMLRefusal(f"over the {MAX_BYTES}-byte limit for a recipe")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise YAMLRefusal(f"not UTF-8 text (byte {exc.start})") from None


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` without aliases, with a depth limit and duplicate-key detection."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        line = event.start_mark.line + 1 if event.start_mark else "?"
        if isinstance(event, yaml.AliasEvent):
            raise YAMLRefusal(f"line {line}: YAML aliases (*{event.anchor}) are not allowed in recipes")
        if getattr(event, "anchor", None):
            raise YAMLRefusal(f"line {line}: YAML anchors (&{event.anchor}) are not allowed in recipes")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YAMLRefusal(f"line {line}: nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise YAMLRefusal(f"line {line}: YAML merge keys (<<) are not allowed in recipes")
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                raise YAMLRefusal(f"line {line}: a key must be a string") from None
            if first is not None:
                raise YAMLRefusal(f"line {line}: key {shown(key)} is given twice (lines {first} and {line})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_recipe_yaml(text: str) -> Any:
    """Parse recipe YAML under the limits in the module docs (``yaml.YAMLError`` for malformed YAML)."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise YAMLRefusal(f"over the {MAX_BYTES}-byte limit for a recipe")
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
