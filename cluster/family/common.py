"""Helpers shared by the family build: torch thread-count control (a fixed count, and a tuner that times
1 vs. ``max_threads`` threads), silencing transformers' progress bars, progress bars and parameter counts."""
from __future__ import annotations

import contextlib
import time

import torch
from tqdm.auto import tqdm


@contextlib.contextmanager
def _torch_threads(n: int):

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class _ThreadTuner:
    """Choose between 1 and ``max_threads`` torch threads by timing real steps.

    On an idle 2-core machine two intra-op threads are clearly faster than one,
    but when other processes compete for the cores every parallel op waits for
    whichever thread was descheduled, and two threads become several times
    *slower* than one.  Every ``period`` steps this times one step with each
    setting and keeps the faster.  The thread count does not change results.
    """

    def __init__(self, max_threads: int, period: int = 25):
        self.max = max(1, max_threads)
        self.period = period
        self.choice = self.max
        self.step = 0
        self.plan: list[int] = []
        self.trial: dict[int, float] = {}
        self.used: dict[int, int] = {}
        self._t0 = 0.0
        self._cur = self.max

    def __enter__(self):

        if self.max > 1 and self.step >= 1 and (self.step - 1) % self.period == 0:
            self.plan, self.trial = [self.max, 1], {}  # skip step 0: it includes warm-up
        self._cur = self.plan[0] if self.plan else self.choice
        torch.set_num_threads(self._cur)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        dt = time.perf_counter() - self._t0
        if self.plan:
            self.trial[self.plan.pop(0)] = dt
            if not self.plan:
                self.choice = min(self.trial, key=self.trial.get)
        self.used[self._cur] = self.used.get(self._cur, 0) + 1
        self.step += 1
        return False

    def summary(self) -> dict:
        return {str(k): v for k, v in sorted(self.used.items())}


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' own progress bars (e.g. "Writing model shards")."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _bar(progress: bool, **kw):

    return tqdm(disable=not progress, dynamic_ncols=True, **kw)


def _n_params(model) -> int:
    # tied embeddings are counted once
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
