"""Bounded text for messages: a user's value is shown, never all of it."""

from __future__ import annotations

from typing import Any

__all__ = ["shorten", "shown"]


def shorten(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, ending in ``...`` when cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters."""
    return shorten(repr(value), limit)
