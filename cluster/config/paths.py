"""Where the embedded family and derived tables live on disk (paths only: nothing here builds).

Building a missing family or bigram table is an entry point's job (:func:`cluster.family.ensure_built`);
loaders only ask for paths and fail with a clear :class:`ConfigError` when something is missing.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cluster.config.schema import Config
from cluster.errors import ConfigError

ZOO_VERSION = 3
BIGRAM_FILE = "bigram.npy"
HEAD_DIR = "specdec-head"


def default_cache_dir() -> Path:
    """``$SPECSERVE_CACHE/zoo-v<N>`` if the variable is set, else ``~/.cache/specserve/zoo-v<N>``."""
    base = os.environ.get("SPECSERVE_CACHE")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "specserve"
    return root / f"zoo-v{ZOO_VERSION}"


def family_cache(cfg: Config) -> Path:
    """The embedded family's cache directory for ``cfg`` (whether or not it is built)."""
    return Path(cfg.zoo_cache_dir).expanduser() if cfg.zoo_cache_dir else default_cache_dir()


def family_is_built(cache: Path) -> bool:
    """Whether ``cache`` holds a complete build (its manifest is written last)."""
    return (Path(cache) / "manifest.json").is_file()


def zoo_dir(cfg: Config) -> Path:
    """The built family's cache directory; a clear error if it is not built yet."""
    cache = family_cache(cfg)
    if not family_is_built(cache):
        raise ConfigError(f"the embedded model family is not built in {cache}: run `specserve zoo build`")
    return cache


def default_bigram_path(cfg: Config) -> Path:
    """The Max-Gram bigram file for ``cfg``.

    ``cfg.mag.bigram`` if set; for the embedded family ``<zoo cache>/mag/bigram.npy``; for a ``path``
    target ``~/.cache/specserve/mag/bigram-<hash of the checkpoint path>.npy``; for tiny (byte-level)
    configs ``~/.cache/specserve/mag/bigram-bytes.npy``.
    """
    if getattr(cfg, "mag", None) is not None and cfg.mag.bigram:
        return Path(cfg.mag.bigram).expanduser()
    spec = cfg.models[cfg.target]
    if spec.zoo is not None:
        return family_cache(cfg) / "mag" / BIGRAM_FILE
    if spec.path is not None:
        h = hashlib.sha1(str(Path(spec.path).expanduser().resolve()).encode()).hexdigest()[:12]
        return default_cache_dir().parent / "mag" / f"bigram-{h}.npy"
    return default_cache_dir().parent / "mag" / "bigram-bytes.npy"
