"""Tiny random-initialised Llama models built on the fly (seeded), for tests and quick checks.

The drafters are truncations of the target (its first layers, sharing its embeddings and head), so
they agree with it often enough to exercise acceptance, bonus and rejection paths without any
training.  All share :class:`cluster.models.tokenizer.ByteTokenizer`'s vocabulary.
"""
from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.models.tokenizer import ByteTokenizer


def tiny_llama(*, hidden: int = 64, layers: int = 4, heads: int = 4, vocab_size: int = ByteTokenizer.vocab_size,
               max_position: int = 1024, seed: int = 0, init_scale: float = 0.2) -> LlamaForCausalLM:
    """A random Llama with larger-than-default init so its distributions are far from uniform."""
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=max_position, initializer_range=init_scale,
                      tie_word_embeddings=False, eos_token_id=ByteTokenizer.eos_token_id,
                      bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.eval()
    return model


def truncated(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """A drafter made of the target's first ``layers`` decoder layers (self-speculation style)."""
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = layers
    small = LlamaForCausalLM(cfg)
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    small.load_state_dict(state)
    return small.eval()
