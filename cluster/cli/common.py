"""What every ``specserve`` verb shares: loading a config with what it needs built, and the thread policy."""
from __future__ import annotations

import importlib.util
import os


from cluster.config.schema import load_config
from cluster.errors import ConfigError, check_int
from cluster.family import ensure_built
from cluster.models.host import setup_process

EXIT_USAGE = 2


def load_built_config(path: str):
    """Load the YAML config at ``path`` and build what it needs that is not cached yet (the embedded
    family, the Max-Gram bigram table): the entry point's job, never a loader's."""
    cfg = load_config(path)
    ensure_built(cfg)
    return cfg


def configure_threads() -> int:
    """Torch intra-op threads for everything the CLI runs: ``SPECSERVE_THREADS``, default 1.

    The models here are small: a forward pass is a few ms of many small ops, and on a shared 2-core
    machine a 2-thread pool stalls whenever its second worker is descheduled, which slowed speculative
    decoding far more than plain decoding.
    """

    n = check_int("SPECSERVE_THREADS", os.environ.get("SPECSERVE_THREADS", "1"), 1, 256)
    setup_process(n)
    return n


def require_extra(extra: str, *modules: str) -> None:
    """Refuse a command whose optional dependencies (pyproject.toml's ``[extra]``) are not installed: the
    serving image installs the serving set only."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"this command needs {', '.join(missing)}: pip install 'specserve[{extra}]' "
                          f"(make setup installs every extra)")
