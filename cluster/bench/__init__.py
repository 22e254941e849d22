"""Benchmarks: one module per suite, :mod:`cluster.bench.report` shared by all (and importing none).

``SUITES`` maps a suite name (``specserve bench --suite``) to its ``run(args, cfg) -> exit code``.
"""
from __future__ import annotations

from cluster.bench import (cluster, cs, edit, gpu, grammar, load, main, served, simulate_suite, spec_cascades,
                           transport, verify)

SUITES = {
    "main": main.run,
    "cluster": cluster.run,
    "verify": verify.run_verify,
    "cascades": spec_cascades.run_cascades,
    "cs": cs.run,
    "load": load.run,
    "served": served.run,
    "transport": transport.run,
    "edit": edit.run,
    "grammar": grammar.run,
    "gpu": gpu.run,
    "simulate": simulate_suite.run,
}
