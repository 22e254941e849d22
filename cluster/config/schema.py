"""YAML configuration parsed with ``yaml.safe_load`` into typed, validated dataclasses.

Every error names the offending field by its dotted path (``models.target.tiny.layers``).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.config.layout import ClusterSpec
from cluster.core.sampling import SamplingParams
from cluster.core.suffix import DEFAULT_MAX_DEPTH, DEFAULT_MAX_TOKENS, DEFAULT_MIN_PROB, DEFAULT_SPEC_FACTOR
from cluster.errors import ConfigError, ParamError, check_config_choice
from cluster.strategies import REGISTRY, all_options


@dataclass(frozen=True)
class TinySpec:
    """A random-initialised Llama built on the fly; ``truncate`` = first N layers of the target."""

    hidden: int = 64
    layers: int = 4
    heads: int = 4
    seed: int = 0
    max_position: int = 1024
    truncate: int | None = None

    def validate(self, path: str) -> None:
        for name in ("hidden", "layers", "heads", "max_position"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}: must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ConfigError(f"{path}.hidden: must be divisible by heads ({self.heads}), got {self.hidden}")
        if self.truncate is not None and self.truncate < 1:
            raise ConfigError(f"{path}.truncate: must be >= 1, got {self.truncate}")


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from: exactly one of ``zoo`` (embedded family), ``path`` (a local HF
    checkpoint directory) or ``tiny``."""

    zoo: str | None = None
    path: str | None = None
    tiny: TinySpec | None = None
    dtype: str = "float32"
    device: str = "cpu"

    def validate(self, path: str) -> None:
        given = [k for k in ("zoo", "path", "tiny") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ConfigError(f"{path}: give exactly one of zoo, path, tiny (got {given or 'none'})")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"{path}.dtype: one of float32, bfloat16, float16, got {self.dtype!r}")
        if self.tiny is not None:
            self.tiny.validate(f"{path}.tiny")


OVERLAP = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineSpec:
    strategy: str = "speculative"
    max_new_tokens_limit: int = 1024
    options: dict[str, Any] = field(default_factory=dict)   # default strategy options
    max_batch: int = 32                     # requests decoded together in one engine step (per serving unit)
    max_queue: int = 64                     # requests waiting for a place; beyond: RESOURCE_EXHAUSTED / 429
    # KV positions the running requests may reserve; None: derived from the models' KV bytes per token and their
    # devices' memory (cluster/engine/kv_budget.py): kv_memory_fraction of it for weights and KV, the memory
    # detected unless device_memory_gib says it
    kv_budget_tokens: int | None = None
    kv_memory_fraction: float = 0.9
    device_memory_gib: float | None = None
    request_timeout_s: float | None = 600.0  # server-side deadline: a request still running then is stopped
    # drafting the next block while the target verifies this one (PEARL's post-verify; docs/operator-guide.md):
    # auto = where the draft side has a process of its own (the separated topology), on = also in-process
    # (no concurrency there: for tests), off = never
    overlap: str = "auto"
    # the speculation policy's knob (cluster/engine/policy.py): from this many running requests up, the drafting
    # strategies with a fixed draft length (speculative, mag, cs_drafting) decode plainly (vLLM's
    # speculative_disable_by_batch_size, per step); null: never
    plain_from_batch: int | None = None
    # how a step's rows are sampled and verified: batched = the whole round in one call on the target's device
    # (cluster/core/rejection.py); reference = row by row on the host in float64 (the test oracle)
    sampler: str = "batched"
    # automatic prefix caching (cluster/models/prefix_cache.py): a prompt's leading blocks already computed on a
    # model (an earlier turn, a shared system prompt) are not computed again, on the target and every drafter
    prefix_caching: str = "on"
    # a request whose target state is lost (the target's actor died, a rank was replaced) starts again from its
    # prompt and the tokens it emitted, exactly, once the target answers, at most this many times (0: it fails
    # with UNAVAILABLE); cluster/engine/engine.py, Engine._suspend
    resume_limit: int = 3

    def overlap_on(self, draft_side_remote: bool) -> bool:
        """What ``overlap`` means, decided here only: pre-draft where the draft side has a process of its own
        (``auto``, ``on``), also in-process (``on``), never (``off``)."""
        return self.overlap == "on" or (self.overlap == "auto" and draft_side_remote)

    @property
    def capacity(self) -> int:
        """Requests one engine admits at once (running + queued)."""
        return self.max_batch + self.max_queue

    def validate(self, path: str) -> None:
        for name, low, high in (("max_batch", 1, 4096), ("max_queue", 0, 1 << 20)):
            v = getattr(self, name)
            if not low <= v <= high:
                raise ConfigError(f"{path}.{name}: must be in [{low}, {high}], got {v}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ConfigError(f"{path}.request_timeout_s: must be > 0 (or null: no deadline), "
                              f"got {self.request_timeout_s}")
        if self.kv_budget_tokens is not None and self.kv_budget_tokens < 1:
            raise ConfigError(f"{path}.kv_budget_tokens: must be >= 1 (or null: derived from device memory), "
                              f"got {self.kv_budget_tokens}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ConfigError(f"{path}.kv_memory_fraction: must be in (0, 1], got {self.kv_memory_fraction}")
        if self.device_memory_gib is not None and not 0 < self.device_memory_gib <= 1 << 20:
            raise ConfigError(f"{path}.device_memory_gib: must be in (0, 1048576] (or null: detected), "
                              f"got {self.device_memory_gib}")
        if self.plain_from_batch is not None and not 1 <= self.plain_from_batch <= 4096:
            raise ConfigError(f"{path}.plain_from_batch: must be in [1, 4096] (or null: never), "
                              f"got {self.plain_from_batch}")
        if not 0 <= self.resume_limit <= 100:
            raise ConfigError(f"{path}.resume_limit: must be in [0, 100], got {self.resume_limit}")
        if self.prefix_caching not in ("on", "off"):
            raise ConfigError(f"{path}.prefix_caching: must be one of on, off, got {self.prefix_caching!r}")
        if self.sampler not in ("batched", "reference"):
            raise ConfigError(f"{path}.sampler: must be one of batched, reference, got {self.sampler!r}")
        check_config_choice(f"{path}.overlap", self.overlap, OVERLAP)
        check_config_choice(f"{path}.strategy", self.strategy, sorted(REGISTRY))
        if self.max_new_tokens_limit < 1:
            raise ConfigError(f"{path}.max_new_tokens_limit: must be >= 1, got {self.max_new_tokens_limit}")
        known = all_options()
        for key, value in self.options.items():
            if key not in known:
                raise ConfigError(f"{path}.options.{key}: unknown option (known: {', '.join(sorted(known))})")
            try:
                known[key].parse(value)
            except ParamError as e:
                raise ConfigError(f"{path}.options.{key}: {e}") from None


@dataclass(frozen=True)
class GenerationSpec:
    """Request defaults for the CLI and the bench."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def validate(self, path: str) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"{path}.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        try:
            self.sampling()
        except ParamError as e:
            raise ConfigError(f"{path}.{e.name}: {e}") from None

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


@dataclass(frozen=True)
class MagSpec:
    """The Max-Gram statistical drafter (Chen et al., *Cascade Speculative Drafting for Even Faster LLM Inference*,
    section 3.3), served as model ``name``.

    ``bigram``: a table file from ``specserve mag build-bigram`` (default: built from the zoo's training
    corpus and cached, see :func:`cluster.config.paths.default_bigram_path`).

    ``occurrence`` / ``max_ngram``: copy after the most ``recent`` earlier occurrence of the longest suffix match,
    matches capped at 24 tokens (ours, the default), or after the ``first`` one with ``max_ngram: 0`` (no cap: the
    paper's appendix A); see :mod:`cluster.core.maxgram`.
    """

    name: str = "mag"
    bigram: str | None = None
    max_ngram: int = 24
    occurrence: str = "recent"

    def validate(self, path: str) -> None:
        if self.max_ngram < 0:
            raise ConfigError(f"{path}.max_ngram: must be >= 0 (0: no cap), got {self.max_ngram}")
        if self.occurrence not in ("recent", "first"):
            raise ConfigError(f"{path}.occurrence: must be recent or first, got {self.occurrence!r}")


@dataclass(frozen=True)
class SuffixSpec:
    """The suffix drafter (Oliaro et al., *SuffixDecoding*; :mod:`cluster.core.suffix`), served as model ``name``: a
    cross-request index of recent requests' prompts and outputs, one per ``cache_salt``.

    ``max_tokens``: tokens the index holds (finished requests evicted oldest first; each costs a few hundred
    bytes); ``max_depth``: the longest match it indexes; ``spec_factor``: a draft is at most this many times the
    match length; ``min_prob``: drafting stops once the draft's probability (the product of its tokens' empirical
    probabilities) falls below this.
    """

    name: str = "suffix"
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_depth: int = DEFAULT_MAX_DEPTH
    spec_factor: float = DEFAULT_SPEC_FACTOR
    min_prob: float = DEFAULT_MIN_PROB

    def validate(self, path: str) -> None:
        for field_, low, high, value in (("max_tokens", 1, 1 << 30, self.max_tokens),
                                         ("max_depth", 2, 1024, self.max_depth)):
            if not low <= value <= high:
                raise ConfigError(f"{path}.{field_}: must be in [{low}, {high}], got {value}")
        if not 0 < self.spec_factor <= 1024:
            raise ConfigError(f"{path}.spec_factor: must be in (0, 1024], got {self.spec_factor}")
        if not 0 <= self.min_prob <= 1:
            raise ConfigError(f"{path}.min_prob: must be in [0, 1], got {self.min_prob}")


TOOL_PARSERS = ("hermes", "llama3_json", "mistral")    # cluster/models/tool_calls.py: FORMATS


@dataclass(frozen=True)
class ChatSpec:
    """Chat completions.  ``tool_parser``: the format the served checkpoint writes tool calls in (vLLM's
    ``--tool-call-parser`` names): ``hermes`` (Hermes, Qwen 2.5 / 3; the embedded family's template),
    ``llama3_json`` (Llama 3.x), ``mistral``."""

    tool_parser: str = "hermes"

    def validate(self, path: str) -> None:
        check_config_choice(f"{path}.tool_parser", self.tool_parser, TOOL_PARSERS)


@dataclass(frozen=True)
class Config:
    models: dict[str, ModelSpec]
    target: str = "target"
    engine: EngineSpec = field(default_factory=EngineSpec)
    generation: GenerationSpec = field(default_factory=GenerationSpec)
    zoo_cache_dir: str | None = None
    mag: MagSpec | None = None          # add the Max-Gram drafter to the served models
    suffix: SuffixSpec | None = None    # add the suffix drafter (past outputs as drafts) to the served models
    cluster: ClusterSpec = field(default_factory=ClusterSpec)   # Ray layout (cluster/config/layout.py)
    chat: ChatSpec = field(default_factory=ChatSpec)            # tool-call format of /v1/chat/completions
    source: str = "<dict>"

    def validate(self) -> None:
        if self.target not in self.models:
            raise ConfigError(f"target: {self.target!r} is not one of models ({', '.join(self.models)})")
        for name, spec in self.models.items():
            spec.validate(f"models.{name}")
            if spec.tiny is not None and spec.tiny.truncate is not None and \
                    (self.models[self.target].tiny is None or name == self.target):
                raise ConfigError(f"models.{name}.tiny.truncate: needs a tiny target other than itself")
        if self.mag is not None:
            self.mag.validate("mag")
            if self.mag.name in self.models:
                raise ConfigError(f"mag.name: {self.mag.name!r} clashes with a model in models")
        if self.suffix is not None:
            self.suffix.validate("suffix")
            if self.suffix.name in self.models or (self.mag is not None and self.suffix.name == self.mag.name):
                raise ConfigError(f"suffix.name: {self.suffix.name!r} clashes with a model in models or mag.name")
        self.engine.validate("engine")
        self.generation.validate("generation")
        self.cluster.validate("cluster")
        self.chat.validate("chat")
        drafter = self.engine.options.get("drafter")
        if drafter is not None and (drafter not in self.models or drafter == self.target):
            raise ConfigError(f"engine.options.drafter: {drafter!r} is not a drafter in models")

    @property
    def drafters(self) -> list[str]:
        return [n for n in self.models if n != self.target]

    @property
    def statistical(self) -> list[str]:
        """The statistical drafters served beside the models (Max-Gram, the suffix drafter): no checkpoint, the
        target's vocabulary."""
        return [spec.name for spec in (self.mag, self.suffix) if spec is not None]


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    return config_from_dict(data, source=str(p))


def config_from_dict(data: Any, source: str = "<dict>") -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping")
    cfg = _build(Config, {**data, "source": source}, "")
    cfg.validate()
    return cfg


def _build(cls, data: Any, path: str):
    """Construct dataclass ``cls`` from a mapping, checking field names and types recursively."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = set(data) - set(fields)
    if unknown:
        name = sorted(unknown)[0]
        raise ConfigError(f"{_join(path, name)}: unknown field (allowed: {', '.join(fields)})")
    kwargs = {k: _coerce(hints[k], v, _join(path, k)) for k, v in data.items()}
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{_join(path, missing[0])}: required field missing")
    return cls(**kwargs)


def _coerce(tp, value, path):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, path)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        _, vt = typing.get_args(tp)
        return {str(k): (v if vt is Any else _coerce(vt, v, _join(path, str(k)))) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, bool):          # YAML reads a bare on/off/yes/no as a boolean
        return "on" if value else "off"
    if tp in (int, float, str, bool) and (not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
    return value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
