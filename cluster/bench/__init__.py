"""Benchmarks: one module per suite, :mod:`cluster.bench.report` shared by all (and importing none).

``SUITES`` maps a suite name (``specserve bench --suite``) to its ``run(args, cfg) -> exit code``.  A suite's
module is imported when it is first looked up, not with the package: so a machine that has only what the
in-process engine needs (torch, transformers; a lent GPU machine, say) runs ``--suite gpu --runtime
in-process`` without Ray, Serve or the grammar engine installed.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib import import_module
from typing import Callable

_WHERE = {                                   # suite -> (module under cluster.bench, function)
    "main": ("main", "run"),
    "verify": ("verify", "run_verify"),
    "cascades": ("spec_cascades", "run_cascades"),
    "cs": ("cs", "run"),
    "load": ("load", "run"),
    "served": ("served", "run"),
    "edit": ("edit", "run"),
    "grammar": ("grammar", "run"),
    "gpu": ("gpu", "run"),
    "shapes": ("shapes", "run"),
    "chat": ("chat", "run"),
}


class _Suites(Mapping):
    """The registry, read like a dict; each value is the suite's ``run`` function, imported on first use."""

    def __getitem__(self, name: str) -> Callable:
        module, function = _WHERE[name]
        return getattr(import_module(f"cluster.bench.{module}"), function)

    def __iter__(self) -> Iterator[str]:
        return iter(_WHERE)

    def __len__(self) -> int:
        return len(_WHERE)


SUITES: Mapping[str, Callable] = _Suites()
