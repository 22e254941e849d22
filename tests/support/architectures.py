"""Tiny random checkpoints of many architectures, written with ``save_pretrained`` (seeded, a few seconds
each), all over one 384-id vocabulary so any of them can draft for any other; and the oracle the matrix
compares with: transformers' own forward on the full sequence, no cache.

Sliding windows are small (8-14) so a 6..20-token prompt plus 32 new tokens passes every window; every
config whose checkpoints have a tensor-parallel plan keeps heads and kv heads divisible by 2.
"""
from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

from tests.support.checkpoints import write_word_tokenizer

VOCAB = 384
SLIDING, FULL = "sliding_attention", "full_attention"
_COMMON = dict(vocab_size=VOCAB, initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None,
               eos_token_id=None, pad_token_id=None)
_DECODER = dict(_COMMON, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512)

# name -> (config class, its kwargs): what each checks is named on its line
CONFIGS = {
    "llama": (tf.LlamaConfig, dict(_DECODER, num_hidden_layers=3)),                        # GQA
    "qwen2": (tf.Qwen2Config, dict(_DECODER, num_hidden_layers=2)),
    "qwen2-sliding": (tf.Qwen2Config, dict(_DECODER, num_hidden_layers=3, use_sliding_window=True,
                                            sliding_window=9, max_window_layers=1)),     # mixed: layer 0 full
    "qwen3": (tf.Qwen3Config, dict(_DECODER, num_hidden_layers=2, head_dim=16)),           # q/k norm
    "mistral": (tf.MistralConfig, dict(_DECODER, num_hidden_layers=2, sliding_window=12)),
    "gemma2": (tf.Gemma2Config, dict(_DECODER, num_hidden_layers=4, head_dim=16, sliding_window=10,
                                     query_pre_attn_scalar=16, attn_logit_softcapping=20.0,
                                     final_logit_softcapping=15.0, layer_types=[SLIDING, FULL] * 2)),
    "gemma3": (tf.Gemma3TextConfig, dict(_DECODER, num_hidden_layers=4, head_dim=16, sliding_window=8,
                                         query_pre_attn_scalar=16, layer_types=[SLIDING, SLIDING, FULL, SLIDING])),
    "phi3": (tf.Phi3Config, dict(_DECODER, num_hidden_layers=2, sliding_window=14)),
    "gpt_neox": (tf.GPTNeoXConfig, dict(_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, rotary_pct=0.25, use_parallel_residual=True,
                                        max_position_embeddings=512)),
    "gpt2": (tf.GPT2Config, dict(_COMMON, n_embd=64, n_layer=2, n_head=4, n_positions=256)),   # learned positions
    "olmo2": (tf.Olmo2Config, dict(_DECODER, num_hidden_layers=2)),
    "granite": (tf.GraniteConfig, dict(_DECODER, num_hidden_layers=2, embedding_multiplier=2.0,
                                       residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=0.5)),
    "mixtral": (tf.MixtralConfig, dict(_DECODER, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                       sliding_window=11)),
    "qwen2_moe": (tf.Qwen2MoeConfig, dict(_DECODER, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    # beyond the list: more of what users bring
    "gemma": (tf.GemmaConfig, dict(_DECODER, num_hidden_layers=2, head_dim=16)),
    "qwen3_moe": (tf.Qwen3MoeConfig, dict(_DECODER, num_hidden_layers=2, head_dim=16, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=32)),
    "starcoder2": (tf.Starcoder2Config, dict(_DECODER, num_hidden_layers=2, sliding_window=10)),
    "olmo3": (tf.Olmo3Config, dict(_DECODER, num_hidden_layers=4, sliding_window=9,
                                   layer_types=[SLIDING, SLIDING, SLIDING, FULL])),
    "ministral": (tf.MinistralConfig, dict(_DECODER, num_hidden_layers=2, head_dim=16, sliding_window=10,
                                           layer_types=[SLIDING, SLIDING])),
    "cohere": (tf.CohereConfig, dict(_DECODER, num_hidden_layers=2)),
    "phi": (tf.PhiConfig, dict(_DECODER, num_hidden_layers=2, partial_rotary_factor=0.5)),         # Phi-2
    "smollm3": (tf.SmolLM3Config, dict(_DECODER, num_hidden_layers=4, no_rope_layer_interval=2)),  # NoPE layers
    "exaone4": (tf.Exaone4Config, dict(_DECODER, num_hidden_layers=4, sliding_window=9,
                                       layer_types=[SLIDING, SLIDING, SLIDING, FULL])),
    "glm4": (tf.Glm4Config, dict(_DECODER, num_hidden_layers=2, head_dim=16)),
}


def tiny_model(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Architecture ``name`` of :data:`CONFIGS`, random with the given seed, in eval mode."""
    cls, kwargs = CONFIGS[name]
    config = cls(**dict(kwargs, **overrides))
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config).eval()


def write_checkpoint(root: Path, name: str, seed: int = 0, **overrides) -> Path:
    """``save_pretrained`` of :func:`tiny_model` plus a word-level tokenizer into ``root / name``."""
    out = Path(root) / name
    tiny_model(name, seed, **overrides).save_pretrained(out)
    write_word_tokenizer(out, VOCAB)
    return out


def write_drafter(root: Path, name: str) -> Path:
    """``root / name-drafter``: the seed-0 model ``name``'s first decoder layer with its embeddings and head
    (self-speculation style, so it agrees with the target often enough to exercise acceptance)."""
    cls, kwargs = CONFIGS[name]
    full = tiny_model(name)
    layers = {"num_hidden_layers": 1} if "n_layer" not in kwargs else {"n_layer": 1}
    if "layer_types" in kwargs or kwargs.get("use_sliding_window"):
        layers["layer_types"] = full.config.layer_types[:1]
    small = tf.AutoModelForCausalLM.from_config(cls(**dict(kwargs, **layers))).eval()
    missing = small.load_state_dict(full.state_dict(), strict=False).missing_keys
    assert not missing, missing
    out = Path(root) / f"{name}-drafter"
    small.save_pretrained(out)
    return out


@torch.inference_mode()
def oracle_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy continuation by repeated full forwards without a cache (transformers builds its own masks):
    the tokens, each step's top-2 logit margin (so a caller can stop comparing at a genuine near-tie) and
    each chosen token's log-probability (log_softmax of the raw logits)."""
    ids, margins, logprobs = list(prompt), [], []
    for _ in range(new):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
        top = logits.topk(2)
        margins.append((top.values[0] - top.values[1]).item())
        logprobs.append(torch.log_softmax(logits, -1)[top.indices[0]].item())
        ids.append(int(top.indices[0]))
    return ids[len(prompt):], margins, logprobs
