"""THE one builder: a config's model spec -> a model handle (and the shared tokenizer).

Used by every runtime: :mod:`cluster.local` (in-process), the Ray actors (:mod:`actors.model_actor`,
:mod:`actors.tp`, :mod:`actors.draft_actor`) and the serving unit (:mod:`cluster.serving.control.unit`).  It only
loads: a missing family or bigram table is a clear :class:`ConfigError` (entry points build them first
with :func:`cluster.family.ensure_built`).

With ``tp_size > 1`` the checkpoint is loaded through transformers' own tensor-parallel plan
(``DistributedConfig(tp_size=N)`` = the model's ``base_model_tp_plan``, e.g. Llama's colwise q/k/v/
gate/up and rowwise o/down projections, ``lm_head`` gathered); ``torch.distributed`` must already be
initialised by the caller (:mod:`actors.tp`).  Tiny models are built from their seed; for TP they are
saved to a temporary directory first, so the TP path is the same checkpoint path a real model takes.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from cluster.config.paths import HEAD_DIR, default_bigram_path, zoo_dir
from cluster.config.schema import Config, ModelSpec
from cluster.core.interfaces import BatchedHandle, Tokenizer
from cluster.errors import ConfigError
from cluster.models.batched import BatchedHFWorker
from cluster.models.maxgram import MagHandle, load_bigram
from cluster.models.suffix import SuffixHandle
from cluster.models.tiny import tiny_llama, truncated
from cluster.models.tokenizer import ByteTokenizer, HFTokenizer


def model_path(cfg: Config, spec: ModelSpec) -> Path | None:
    """The local checkpoint directory of a ``zoo`` or ``path`` model (None for ``tiny``)."""
    if spec.zoo is not None:
        path = zoo_dir(cfg) / spec.zoo
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


def _tiny_model(cfg: Config, name: str):
    """A tiny seeded model; a ``truncate`` drafter is the (same-seed) target's first layers."""
    spec = cfg.models[name].tiny
    if spec.truncate is None:
        return tiny_llama(hidden=spec.hidden, layers=spec.layers, heads=spec.heads, seed=spec.seed,
                          max_position=spec.max_position)
    return truncated(_tiny_model(cfg, cfg.target), spec.truncate)


def checkpoint_dir(cfg: Config, name: str) -> Path:
    """A local HF checkpoint directory for model ``name`` (tiny models are saved to a temp dir)."""
    spec = cfg.models[name]
    if spec.tiny is None:
        return model_path(cfg, spec)
    out = Path(tempfile.mkdtemp(prefix=f"specserve-{name}-"))
    _tiny_model(cfg, name).save_pretrained(out)
    return out


def build_handle(cfg: Config, name: str, *, tp_size: int = 1, vocab_size: int | None = None) -> BatchedHandle:
    """The handle for model ``name`` of ``cfg``: a :class:`BatchedHFWorker` (sharded over the current process
    group when ``tp_size > 1``), or the Max-Gram drafter for the ``mag:`` section's name, or the suffix drafter for
    the ``suffix:`` section's (both need the target's ``vocab_size``)."""
    if cfg.suffix is not None and name == cfg.suffix.name:
        sx = cfg.suffix
        return SuffixHandle(vocab_size, name=name, max_depth=sx.max_depth, max_tokens=sx.max_tokens,
                            spec_factor=sx.spec_factor, min_prob=sx.min_prob)
    if cfg.mag is not None and name == cfg.mag.name:
        path = default_bigram_path(cfg)
        if not path.is_file():
            raise ConfigError(f"mag: no bigram table at {path}: run `specserve mag build-bigram`")
        return MagHandle(vocab_size, load_bigram(path), name=name, max_ngram=cfg.mag.max_ngram,
                         occurrence=cfg.mag.occurrence)
    worker = _worker(cfg, name, tp_size)
    worker.prefix_caching = cfg.engine.prefix_caching == "on"
    return worker


def _worker(cfg: Config, name: str, tp_size: int) -> BatchedHFWorker:
    spec = cfg.models[name]
    if tp_size > 1:
        from transformers.distributed import DistributedConfig  # only where TP is used
        return BatchedHFWorker.from_pretrained(checkpoint_dir(cfg, name), name, dtype=spec.dtype, device=spec.device,
                                        distributed_config=DistributedConfig(tp_size=tp_size))
    if spec.tiny is not None:
        return BatchedHFWorker(_tiny_model(cfg, name).to(getattr(torch, spec.dtype)), name)
    worker = BatchedHFWorker.from_pretrained(model_path(cfg, spec), name, dtype=spec.dtype, device=spec.device)
    if spec.zoo is not None:                     # the family's SpecDec++ acceptance head, when built
        head = zoo_dir(cfg) / HEAD_DIR / spec.zoo
        if (head / "head.json").is_file():
            worker.specdec_head = str(head)
    return worker


def model_vocab_size(cfg: Config, name: str) -> int:
    """Model ``name``'s vocabulary size from its config alone (no weights loaded)."""
    spec = cfg.models[name]
    if spec.tiny is not None:
        return int(_tiny_model(cfg, name).config.vocab_size)
    from transformers import AutoConfig                   # heavy: only where a checkpoint is read
    conf = AutoConfig.from_pretrained(str(model_path(cfg, spec)), local_files_only=True)
    return int(conf.get_text_config().vocab_size)


def build_handles(cfg: Config, names: list[str] | None = None) -> dict[str, BatchedHandle]:
    """Handles for ``names`` (default: the target, every drafter and the statistical drafters), target first."""
    if names is None:
        names = [cfg.target] + cfg.drafters + cfg.statistical
    handles: dict[str, BatchedHandle] = {}
    for name in names:
        if name not in cfg.statistical:
            handles[name] = build_handle(cfg, name)
    vocab = {n: h.vocab_size for n, h in handles.items()}
    if len(set(vocab.values())) > 1:
        raise ConfigError(f"models: all models must share one vocabulary, got sizes {vocab}")
    for name in cfg.statistical:
        if name in names:
            handles[name] = build_handle(cfg, name, vocab_size=next(iter(vocab.values())))
    return handles
