"""``specserve bench``: validate the arguments and run the chosen benchmark suites (:data:`cluster.bench.SUITES`),
printing each suite's wall time."""
from __future__ import annotations

import time

from cluster.bench import SUITES
from cluster.cli.common import load_built_config, require_extra
from cluster.config.schema import load_config
from cluster.errors import ParamError, check_float, check_int


OWN_MODELS = {"shapes"}      # suites that write their own checkpoints: the config's models are not built for them


def cmd_bench(args) -> int:
    require_extra("bench", "sacrebleu", "matplotlib")
    suites = [s.strip() for s in getattr(args, "suite", "main").split(",")]
    cfg = load_config(args.config) if set(suites) <= OWN_MODELS else load_built_config(args.config)
    check_int("prompts", args.prompts, 1, 256)
    check_int("max_new_tokens", args.max_new_tokens, 1, cfg.engine.max_new_tokens_limit)
    check_float("temperature", args.temperature, 0.0, 100.0)
    for s in suites:
        if s not in SUITES:
            raise ParamError("suite", "comma-separated of " + ", ".join(SUITES), s)
    rc = 0
    for s in suites:
        t0 = time.perf_counter()
        rc |= SUITES[s](args, cfg)
        print(f"[suite {s}: {time.perf_counter() - t0:.1f}s]")
    return rc
