"""Build presets of the embedded family: :class:`ModelSpec` (one model's architecture), :class:`ZooConfig`
(everything that determines a build, fingerprinted into the manifest), the model names and the EOT token."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from cluster.config.paths import ZOO_VERSION

EOT = "<|endoftext|>"


MODEL_NAMES = ("target", "drafter-large", "drafter-small")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture (and, for the target, training schedule) of one model."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    #: drafters only: start from a copy of the target's embeddings, norm, head
    #: and evenly spaced blocks (requires ``hidden`` == target hidden).
    init_from_target: bool = False


@dataclass(frozen=True)
class ZooConfig:
    """Everything that determines a build (hashed into the manifest)."""

    preset: str
    vocab_size: int
    seq_len: int
    target: ModelSpec
    drafters: tuple[ModelSpec, ...]
    # target pre-training
    target_steps: int
    target_batch: int
    target_lr: float
    # drafter distillation (all drafters trained jointly on the same batches)
    distill_steps: int
    distill_batch: int
    distill_lr: float
    distill_kl_weight: float = 0.9  # loss = w * KL(target || drafter) + (1 - w) * CE
    distill_temperature: float = 1.0
    warmup_frac: float = 0.05
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # data
    max_train_chars: int | None = None  # None: the whole train split
    eval_max_tokens: int = 65536
    eval_batch: int = 16
    # latency measurement
    latency_rounds: int = 5
    latency_iters: int = 30
    latency_warmup: int = 10
    latency_prompt: int = 32
    max_position_embeddings: int = 1024
    #: build fails if params(target) / params(smallest drafter) is below this
    min_param_ratio: float = 10.0

    def fingerprint(self, seed: int) -> str:
        blob = json.dumps({"config": dataclasses.asdict(self), "seed": seed, "v": ZOO_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
