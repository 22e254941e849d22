"""Which checkpoints the batched worker serves exactly, and the attention masks it gives each layer type.

The worker (:mod:`cluster.models.batched`) feeds transformers a *prepared* 4D additive mask ``[B, 1, n, T]``
per forward, which ``transformers.masking_utils`` returns as-is.  A model with one kind of attention takes
one tensor; a model whose ``config.layer_types`` mixes ``full_attention`` and ``sliding_attention`` layers
(Gemma-2, Gemma-3, Qwen2 with ``use_sliding_window``) takes a dict keyed by layer type, exactly as its own
forward builds with ``create_causal_mask`` / ``create_sliding_window_causal_mask``.  Per row b (cached_b
tokens in its slot) and new token j, key position t is visible iff

  full_attention     t <= cached_b + j
  sliding_attention  cached_b + j - W < t <= cached_b + j      (transformers' ``sliding_window_overlay``:
                                                               ``kv_idx > q_idx - sliding_window``)

The layer types and windows come from transformers' own ``get_layer_types_and_kwargs`` (what its
``DynamicCache`` builds its layers from), so a Mistral-style ``sliding_window`` on every layer and explicit
``layer_types`` are read the same way.  :func:`attention_layout` is also the one load-time check: anything
the worker cannot serve exactly raises :class:`ConfigError` naming the architecture and why.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from cluster.errors import ConfigError

FULL, SLIDING = "full_attention", "sliding_attention"

# model_type -> the architecture tests/models/test_architectures.py checks exact (greedy equality with
# transformers' own no-cache forward for every lossless strategy, batched, mixed drafters, TP where planned)
VERIFIED = {
    "llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gemma2": "Gemma-2",
    "gemma3_text": "Gemma-3 (text)", "phi3": "Phi-3", "gpt_neox": "GPT-NeoX", "gpt2": "GPT-2", "olmo2": "OLMo-2",
    "granite": "Granite", "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "gemma": "Gemma", "qwen3_moe": "Qwen3-MoE",
    "starcoder2": "Starcoder2", "olmo3": "OLMo-3", "ministral": "Ministral", "cohere": "Cohere", "phi": "Phi-2",
    "smollm3": "SmolLM3", "exaone4": "EXAONE-4", "glm4": "GLM-4",
}


@dataclass(frozen=True)
class AttentionLayout:
    """layer_types ``[L]`` (FULL or SLIDING per decoder layer); windows: SLIDING -> its window W in tokens;
    mapping: the model's forward takes a dict of masks keyed by layer type (else one tensor)."""
    layer_types: tuple[str, ...]
    windows: dict[str, int]
    mapping: bool

    @property
    def types(self) -> list[str]:
        return sorted(set(self.layer_types))


def _refuse(config, why: str) -> ConfigError:
    arch = ", ".join(getattr(config, "architectures", None) or []) or config.__class__.__name__
    return ConfigError(f"model architecture {arch} (model_type {config.model_type!r}) cannot be served exactly: {why}")


def read_config(path) -> PretrainedConfig:
    """A checkpoint directory's config through transformers (local files only; no remote code is run), or a
    :class:`ConfigError` naming the directory when transformers does not know its architecture."""
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (KeyError, ValueError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"model directory {path}: transformers cannot read its config.json ({first}); "
                          "architectures that need trust_remote_code are not served") from None


def attention_layout(config, model_cls: type | None = None) -> AttentionLayout:
    """The layout of a checkpoint's ``config`` (and its causal-LM class, looked up when not given), or a
    :class:`ConfigError` when the worker cannot reproduce transformers' numbers for it."""
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(config, "encoder-decoder models are not served (the worker hosts decoder-only causal LMs)")
    if model_cls is None:
        try:
            model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        except KeyError:
            raise _refuse(config, "transformers has no causal-LM class for it") from None
    if getattr(model_cls, "_is_stateful", False):
        raise _refuse(config, "it keeps a recurrent state (Mamba / hybrid) that a slot KV cache cannot roll back")
    if config.model_type not in VERIFIED:
        raise _refuse(config, "it is not in the architecture matrix verified exact "
                              f"(tests/models/test_architectures.py): {', '.join(VERIFIED.values())}")
    impl = getattr(config, "_attn_implementation", None)
    if impl not in (None, "eager", "sdpa"):
        raise _refuse(config, f"attn_implementation {impl!r}: the worker's prepared 4D masks need eager or sdpa "
                              "(flash and flex kernels take no such mask)")
    text = config.get_text_config(decoder=True)
    if getattr(text, "use_bidirectional_attention", False):
        raise _refuse(config, "use_bidirectional_attention=True is not causal")
    types, kwargs = get_layer_types_and_kwargs(text)
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise _refuse(config, f"layer types {unknown} (only full_attention and sliding_attention are served)")
    windows: dict[str, set[int]] = {}
    for kind, kw in zip(types, kwargs):
        if kind == SLIDING:
            windows.setdefault(kind, set()).add(int(kw["sliding_window"]))
    if any(len(w) > 1 or min(w) < 1 for w in windows.values()):
        raise _refuse(config, f"sliding windows per layer type must be one positive size, got {windows}")
    # a model that mixes layer types takes a dict of masks keyed by type (each verified one: the matrix)
    mapping = len(set(types)) > 1
    return AttentionLayout(tuple(types), {k: min(w) for k, w in windows.items()}, mapping)


def check_tensor_parallel(config, tp_size: int) -> None:
    """Refuse ``tp_size`` ranks for a checkpoint transformers has no tensor-parallel plan for
    (``base_model_tp_plan``, e.g. GPT-2) or whose attention / key-value heads do not split evenly."""
    text = config.get_text_config(decoder=True)
    if not getattr(text, "base_model_tp_plan", None):
        raise _refuse(config, f"tp_size={tp_size}: transformers has no tensor-parallel plan (base_model_tp_plan) "
                              "for it; serve it with cluster.tp_size: 1")
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if not heads or heads % tp_size or kv % tp_size:
        raise _refuse(config, f"tp_size={tp_size} must divide its {heads} attention and {kv} key/value heads")


def position_limit(config) -> int:
    """The longest sequence the checkpoint's positions cover (``max_position_embeddings``; GPT-2's
    ``n_positions`` through its attribute map).  A sliding window does not limit it: later positions still
    have embeddings, only the attention span is windowed."""
    text = config.get_text_config(decoder=True)
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit < 1:
        raise _refuse(config, "its config names no max_position_embeddings, so its context limit is unknown")
    return limit


def build_masks(layout: AttentionLayout, offsets: list[int], n: int, length: int, dtype: torch.dtype,
                device) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive masks ``[B, 1, n, T]`` (0 visible, dtype min hidden; T = ``length``) for rows with
    ``offsets [B]`` cached positions receiving ``n`` new tokens each: one tensor, or one per layer type."""
    query = torch.tensor(offsets, device=device)[:, None] + torch.arange(n, device=device)      # [B, n]
    key = torch.arange(length, device=device)[None, None, :]                                   # [1, 1, T]
    masks = {}
    for kind in layout.types:
        visible = key <= query[:, :, None]                                                      # [B, n, T]
        if kind == SLIDING:
            visible &= key > query[:, :, None] - layout.windows[kind]
        # additive float for every implementation: with sdpa a bool mask was measured slower at 16-32 rows
        masks[kind] = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(
            ~visible, torch.finfo(dtype).min)[:, None]
    return masks if layout.mapping else next(iter(masks.values()))
