"""The embedded model family ("zoo"): presets, corpus, tokenizer, training, evaluation, SpecDec++ heads,
the Max-Gram bigram table, the cache and the build.  Never imported at serve time.

:func:`ensure_built` is what entry points (CLI, benchmarks, test fixtures) call before loading a
config, so loaders never train or build anything themselves.
"""
from __future__ import annotations

import time
from pathlib import Path

from cluster.config.paths import family_cache
from cluster.config.schema import Config
from cluster.family.bigram import ensure_bigram
from cluster.family.build import build_zoo
from cluster.family.template_file import ensure_chat_template
from cluster.family.heads import build_head


def build_family(cache: Path, *, seed: int = 0, force: bool = False, progress: bool = True) -> dict:
    """Build (or reuse) the family in ``cache`` plus its SpecDec++ heads; returns the manifest."""
    manifest = build_zoo(cache, seed=seed, force=force, progress=progress)
    ensure_chat_template(cache)                 # also into a family cached before it had a template
    t0 = time.perf_counter()
    if build_head(cache, seed=seed, force=force, progress=progress) and progress:
        print(f"SpecDec++ acceptance heads trained in {time.perf_counter() - t0:.0f} s")
    return manifest


def ensure_built(cfg: Config, *, progress: bool = True) -> None:
    """Build what ``cfg`` needs and is missing: the embedded family (if any model is a ``zoo:`` model)
    and the Max-Gram bigram table (if the config has a ``mag:`` section)."""
    if any(spec.zoo is not None for spec in cfg.models.values()):
        build_family(family_cache(cfg), progress=progress)
    if cfg.mag is not None:
        ensure_bigram(cfg)
