"""Build presets of the embedded family: :class:`ModelSpec` (one model's architecture), :class:`ZooConfig`
(everything that determines a build, fingerprinted into the manifest), :data:`PRESETS` (``full``, the
default family, and ``tiny``, for tests), the model names and the EOT token."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch

from cluster.config.paths import ZOO_VERSION

EOT = "<|endoftext|>"
#: fields added to :class:`ZooConfig` after v3, with their defaults (see :meth:`ZooConfig.fingerprint`)
LATER_FIELDS = {"edit_rows": 0, "edit_eval_requests": 8}


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
    #: share the input embedding matrix with the LM head
    tie_embeddings: bool = True


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
    #: forward passes during training under CPU autocast to bfloat16 ("bfloat16") or in float32; weights,
    #: optimizer state and the saved checkpoints stay float32 either way
    train_autocast: str = "float32"
    #: learning-rate factor for the target's embeddings and LM head when the two are untied
    embedding_lr_scale: float = 1.0
    grad_clip: float = 1.0
    #: instruction phase (:mod:`cluster.family.instruct`): rows of chat-rendered pairs added to each batch of
    #: the target's last ``instruct_steps`` steps and of every distillation step (0: no instruction phase)
    instruct_rows: int = 0
    instruct_steps: int = 0
    #: edit pairs (:mod:`cluster.family.edits`): rows added to the same batches as the instruction rows
    edit_rows: int = 0
    #: held-out edit requests answered greedily by the target in the build's edit evaluation
    edit_eval_requests: int = 8
    #: held-out requests answered greedily by the target in the build's chat evaluation, and their token cap
    chat_eval_requests: int = 16
    chat_eval_tokens: int = 160
    # data
    max_train_chars: int | None = None  # None: the whole train split
    eval_max_tokens: int = 65536
    eval_batch: int = 16
    # latency measurement
    latency_rounds: int = 5
    latency_iters: int = 30
    latency_warmup: int = 10
    latency_prompt: int = 32
    #: batch sizes at which each model's cost (ms per call over the target's) is measured
    cost_batches: tuple[int, ...] = (1, 16)
    max_position_embeddings: int = 1024
    #: build fails if params(target) / params(smallest drafter) is below this
    min_param_ratio: float = 10.0

    def __post_init__(self):
        if self.train_autocast not in ("float32", "bfloat16"):
            raise ValueError(f"train_autocast must be 'float32' or 'bfloat16', got {self.train_autocast!r}")
        if not 0 <= self.instruct_steps <= self.target_steps or self.instruct_rows < 0 or self.edit_rows < 0:
            raise ValueError(f"instruct_steps must be in [0, target_steps={self.target_steps}] and instruct_rows "
                             f">= 0 (edit_rows too), got {self.instruct_steps}, {self.instruct_rows} and {self.edit_rows}")

    def fingerprint(self, seed: int) -> str:
        """The build's identity: config, seed and zoo version.  Fields added after a version's builds
        (:data:`LATER_FIELDS`) count only when they differ from their default, so a cached build of a preset
        that does not set them stays valid."""
        config = {k: v for k, v in dataclasses.asdict(self).items() if LATER_FIELDS.get(k, object()) != v}
        blob = json.dumps({"config": config, "seed": seed, "v": ZOO_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def fast_autocast() -> str:
    """``bfloat16`` where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), else ``float32``: elsewhere
    autocast emulates it, and a step of the full target is about 12x slower than in float32 (an AVX2-only CPU:
    9.9 s against 0.8 s a step).  Resolved when the presets are read, so the cache key names what was trained."""
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if native else "float32"


PRESETS: dict[str, ZooConfig] = {
    # Chosen with short experiments and full builds: untied embeddings at 25-40x the blocks' lr reached a far lower
    # held-out loss than tied ones at any lr; a 12-layer target keeps a 2-layer drafter-large cheap against a
    # target call at batch 16 too; 1-layer drafters agreed with the target too rarely.
    "full": ZooConfig(
        preset="full",
        vocab_size=4096,
        seq_len=256,
        target=ModelSpec("target", hidden=192, layers=12, intermediate=512, heads=6, kv_heads=6, tie_embeddings=False),
        drafters=(
            ModelSpec("drafter-large", hidden=192, layers=2, intermediate=512, heads=6, kv_heads=6, init_from_target=True,
                      tie_embeddings=False),
            ModelSpec("drafter-small", hidden=80, layers=2, intermediate=224, heads=2, kv_heads=2),
        ),
        # at this scale progress is limited by the number of optimizer steps more
        # than by tokens per step, so batches are small (4 x 256 tokens).
        target_steps=1500,
        target_batch=4,
        target_lr=1.5e-3,
        embedding_lr_scale=25.0,
        train_autocast=fast_autocast(),
        distill_steps=1000,
        distill_batch=4,
        distill_lr=2e-3,
        # v3: the last 900 target steps and every distillation step add 2 rows of instruction pairs (4,745
        # pairs), loss on the answers only, so the family answers a chat request with code (`specserve zoo info`
        # reports how many greedy answers to held-out requests parse)
        instruct_rows=2,
        instruct_steps=900,
    ),
    # seconds; for tests and smoke runs only (models are essentially untrained).
    "tiny": ZooConfig(
        preset="tiny",
        vocab_size=300,
        seq_len=32,
        target=ModelSpec("target", hidden=64, layers=4, intermediate=128, heads=2, kv_heads=2, tie_embeddings=False),
        drafters=(
            ModelSpec("drafter-large", hidden=64, layers=1, intermediate=128, heads=2, kv_heads=2, init_from_target=True,
                      tie_embeddings=False),
            ModelSpec("drafter-small", hidden=16, layers=1, intermediate=32, heads=1, kv_heads=1),
        ),
        target_steps=4,
        target_batch=4,
        target_lr=3e-3,
        distill_steps=3,
        distill_batch=4,
        distill_lr=3e-3,
        max_train_chars=100_000,
        eval_max_tokens=512,
        eval_batch=4,
        latency_rounds=1,
        latency_iters=3,
        latency_warmup=1,
        latency_prompt=4,
        max_position_embeddings=128,
        train_autocast="bfloat16",   # the full preset's training paths, at toy scale
        embedding_lr_scale=10.0,
        instruct_rows=1,
        instruct_steps=2,
        edit_rows=1,
        edit_eval_requests=2,
        chat_eval_requests=2,
        chat_eval_tokens=8,
    ),
}


def resolve_preset(preset: str | ZooConfig) -> ZooConfig:
    """``preset`` itself if it is a :class:`ZooConfig`, else the named one of :data:`PRESETS` (a clear error
    naming the choices for an unknown name)."""
    if isinstance(preset, ZooConfig):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown zoo preset {preset!r}; choose from {sorted(PRESETS)}") from None
