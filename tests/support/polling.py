"""Synchronisation for end-to-end tests: poll a condition with a deadline, never sleep a fixed time."""
from __future__ import annotations

import time

DEADLINE_S = 60.0


def poll(cond, what: str, timeout: float = DEADLINE_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)                # poll interval; the condition is what synchronises
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
