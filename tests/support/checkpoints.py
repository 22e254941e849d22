"""A tiny Hugging Face checkpoint family on disk (target + one-layer drafter + a word-level tokenizer over 257
ids), for tests that need real ``from_pretrained`` loading, e.g. transformers' tensor-parallel plan."""
from __future__ import annotations

from pathlib import Path


def write_tiny_checkpoints(root: Path, *, hidden: int = 64, layers: int = 3, heads: int = 4, seed: int = 5) -> dict:
    """Write ``root/target`` and ``root/drafter``; returns the ``models:`` section of a config for them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from cluster.models.tiny import tiny_llama, truncated
    model = tiny_llama(hidden=hidden, layers=layers, heads=heads, seed=seed)
    model.save_pretrained(root / "target")
    truncated(model, 1).save_pretrained(root / "drafter")
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(257)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<256>").save_pretrained(root / "target")
    return {"target": {"path": str(root / "target")}, "drafter": {"path": str(root / "drafter")}}
