"""Bounded text for messages: a user's value is shown, never all of it."""

from __future__ import annotations

from typing import Any

__all__ = ["root_cause", "shorten", "shown"]


def shorten(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, ending in ``...`` when cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters."""
    return shorten(repr(value), limit)


def root_cause(exc: BaseException) -> str:
    """``Type: first line`` of the innermost cause of ``exc``: what a one-line error says went wrong underneath."""
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
