"""Errors shared by the engine, the CLI and the servers.

A :class:`ParamError` always names the parameter, the allowed range and the offending value, so the
CLI can print it on one line (exit code 2) and the gRPC front can return it as ``INVALID_ARGUMENT``.
"""
from __future__ import annotations

import reprlib
from typing import Any

SHOWN_CHARS = 80            # an offending value is echoed as at most this many characters of its repr


class ParamError(ValueError):
    """A request or configuration parameter is outside its allowed range.  The value is echoed through
    :func:`shown` (bounded, printable), so a huge, deeply nested or binary value never comes back whole."""

    def __init__(self, name: str, allowed: str, value: Any):
        self.name, self.allowed, self.value = name, allowed, value
        super().__init__(f"invalid {name}: {shown(value)} (allowed: {allowed})")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, SHOWN_CHARS, SHOWN_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 8


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters, in time and memory bounded by ``limit``: strings are cut
    before the repr, containers are shown two levels deep, huge integers by their size; non-printable
    characters (lone surrogates, controls) come out escaped, as ``repr`` writes them."""
    try:
        if isinstance(value, (str, bytes, bytearray)):
            text = repr(value[:limit])
        elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
            text = f"<{'-' if value < 0 else ''}integer of {value.bit_length()} bits>"
        else:
            text = _REPR.repr(value)
    except Exception:                      # noqa: BLE001 - a value whose repr fails is shown by its type
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_text(name: str, value: Any, max_chars: int, *, allow_empty: bool = False) -> str:
    """Return ``value`` if it is a string of at most ``max_chars`` characters of valid Unicode (no lone
    surrogates: it must encode as UTF-8), non-empty unless ``allow_empty``; else raise :class:`ParamError`."""
    allowed = f"text of {0 if allow_empty else 1} to {max_chars} characters"
    if not isinstance(value, str) or len(value) > max_chars or not (value or allow_empty):
        raise ParamError(name, allowed, value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParamError(name, f"{allowed} of valid Unicode (a lone surrogate at character {e.start})",
                         value) from None
    return value


class ConfigError(ValueError):
    """A configuration file is malformed; the message names the field (dotted path)."""


def check_config_choice(path: str, value: Any, choices) -> None:
    """A config field's value must be one of ``choices``: else a :class:`ConfigError` naming its dotted ``path``."""
    if value not in choices:
        raise ConfigError(f"{path}: one of {', '.join(choices)}, got {value!r}")


class OverloadedError(RuntimeError):
    """The server's request queue is full (gRPC ``RESOURCE_EXHAUSTED``)."""


class ModelUnavailableError(RuntimeError):
    """A model (actor) is gone or not answering (gRPC ``UNAVAILABLE``); the message is safe to show."""

    def __init__(self, model: str, why: str = "not available"):
        self.model = model
        super().__init__(f"model {model} is {why}; retry shortly")


class DeadlineExceededError(RuntimeError):
    """A request ran past its deadline and was stopped (gRPC ``DEADLINE_EXCEEDED``)."""


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """Return ``value`` as an int in ``[low, high]`` or raise :class:`ParamError`."""
    allowed = _range_text("integer", low, high)
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            try:
                value = int(value)
            except ValueError:             # digits int() does not take ("²"), or too many of them
                raise ParamError(name, allowed, value) from None
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
    except (TypeError, ValueError, OverflowError):      # OverflowError: an int beyond the float range
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
