"""Build model handles and the tokenizer a config describes (in-process runtime)."""
from __future__ import annotations

from pathlib import Path

from .config import Config, ModelSpec
from .errors import ConfigError
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from .worker import HFWorker


def zoo_dir(cfg: Config, *, build: bool = True, progress: bool = True) -> Path:
    """The embedded family's cache directory, building the family first if it is not cached."""
    from . import zoo
    cache = Path(cfg.zoo_cache_dir).expanduser() if cfg.zoo_cache_dir else zoo.default_cache_dir()
    if not zoo.zoo_is_built(cache):
        if not build:
            raise ConfigError(f"the embedded model family is not built in {cache}: run `specserve zoo build`")
        zoo.build_zoo(cache, progress=progress)
    return cache


def model_path(cfg: Config, spec: ModelSpec, *, build: bool = True) -> Path | None:
    """The local checkpoint directory of a ``zoo`` or ``path`` model (None for ``tiny``)."""
    if spec.zoo is not None:
        path = zoo_dir(cfg, build=build) / spec.zoo
    elif spec.path is not None:
        path = Path(spec.path).expanduser()
    else:
        return None
    if not (path / "config.json").is_file():
        raise ConfigError(f"model directory {path} has no config.json (not a Hugging Face checkpoint)")
    return path


def load_tokenizer(cfg: Config) -> Tokenizer:
    path = model_path(cfg, cfg.models[cfg.target])
    return ByteTokenizer() if path is None else HFTokenizer(path)


def load_models(cfg: Config) -> tuple[dict[str, HFWorker], Tokenizer]:
    """In-process workers for every model in the config, plus the shared tokenizer."""
    from .tiny import tiny_llama, truncated
    workers: dict[str, HFWorker] = {}
    tiny_target = None
    for name in [cfg.target] + cfg.drafters:            # target first: tiny drafters derive from it
        spec = cfg.models[name]
        if spec.tiny is not None:
            t = spec.tiny
            if t.truncate is None:
                model = tiny_llama(hidden=t.hidden, layers=t.layers, heads=t.heads, seed=t.seed,
                                   max_position=t.max_position)
                if name == cfg.target:
                    tiny_target = model
            else:
                model = truncated(tiny_target, t.truncate)
            workers[name] = HFWorker(model, name)
        else:
            workers[name] = HFWorker.from_pretrained(model_path(cfg, spec), name, dtype=spec.dtype,
                                                     device=spec.device)
            if spec.zoo is not None:         # SpecDec++ head built with the zoo (specdec_head.build_head)
                head = zoo_dir(cfg, build=False) / "specdec-head" / spec.zoo
                if (head / "head.json").is_file():
                    workers[name].specdec_head = str(head)
    tokenizer = load_tokenizer(cfg)
    vocab = {n: w.vocab_size for n, w in workers.items()}
    if len(set(vocab.values())) != 1:
        raise ConfigError(f"models: all models must share one vocabulary, got sizes {vocab}")
    if cfg.mag is not None:                  # the Max-Gram drafter (config section ``mag``)
        from .mag import MagHandle, bigram_for
        V = workers[cfg.target].vocab_size
        workers[cfg.mag.name] = MagHandle(V, bigram_for(cfg, tokenizer, V), name=cfg.mag.name,
                                          max_ngram=cfg.mag.max_ngram)
    return workers, tokenizer


def build_engine(cfg: Config):
    """An in-process :class:`cluster.engine.Engine` for ``cfg``."""
    from .engine import Engine
    workers, tokenizer = load_models(cfg)
    return Engine(workers, tokenizer, target=cfg.target, default_strategy=cfg.engine.strategy,
                  defaults=cfg.engine.options, max_new_tokens_limit=cfg.engine.max_new_tokens_limit)
