"""Errors shared by the engine, the CLI and the servers.

A :class:`ParamError` always names the parameter, the allowed range and the offending value, so the
CLI can print it on one line (exit code 2) and the gRPC front can return it as ``INVALID_ARGUMENT``.
"""
from __future__ import annotations

from typing import Any


class ParamError(ValueError):
    """A request or configuration parameter is outside its allowed range."""

    def __init__(self, name: str, allowed: str, value: Any):
        self.name, self.allowed, self.value = name, allowed, value
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"invalid {name}: {shown} (allowed: {allowed})")


class ConfigError(ValueError):
    """A configuration file is malformed; the message names the field (dotted path)."""


class OverloadedError(RuntimeError):
    """The server's request queue is full (gRPC ``RESOURCE_EXHAUSTED``)."""


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """Return ``value`` as an int in ``[low, high]`` or raise :class:`ParamError`."""
    allowed = _range_text("integer", low, high)
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        elif isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ParamError(name, allowed, value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ParamError(name, allowed, value)
    return value


def check_float(name: str, value: Any, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False) -> float:
    """Return ``value`` as a finite float in the (half-)open/closed range or raise :class:`ParamError`."""
    allowed = _range_text("number", low, high, low_open, high_open)
    try:
        if isinstance(value, bool):
            raise TypeError
        f = float(value)
    except (TypeError, ValueError):
        raise ParamError(name, allowed, value) from None
    if f != f or f in (float("inf"), float("-inf")):
        raise ParamError(name, allowed, value)
    if low is not None and (f < low or (low_open and f == low)):
        raise ParamError(name, allowed, value)
    if high is not None and (f > high or (high_open and f == high)):
        raise ParamError(name, allowed, value)
    return f


def check_choice(name: str, value: Any, choices) -> Any:
    """Return ``value`` if it is one of ``choices`` or raise :class:`ParamError`."""
    choices = list(choices)
    if value not in choices:
        raise ParamError(name, "one of " + ", ".join(map(str, choices)), value)
    return value


def _range_text(what: str, low, high, low_open: bool = False, high_open: bool = False) -> str:
    if low is None and high is None:
        return what
    if high is None:
        return f"{what} {'>' if low_open else '>='} {low}"
    if low is None:
        return f"{what} {'<' if high_open else '<='} {high}"
    return f"{what} in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
