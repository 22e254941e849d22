"""A tiny Hugging Face checkpoint family on disk (target + one-layer drafter + a word-level tokenizer over 257
ids), for tests that need real ``from_pretrained`` loading, e.g. transformers' tensor-parallel plan."""
from __future__ import annotations

from pathlib import Path


def write_word_tokenizer(out: Path, vocab: int) -> None:
    """A word-level tokenizer over ``vocab`` ids (``<i>`` is id i, the last id is EOS) saved into ``out``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"<{vocab - 1}>").save_pretrained(out)


def write_tiny_checkpoints(root: Path, *, hidden: int = 64, layers: int = 3, heads: int = 4, seed: int = 5) -> dict:
    """Write ``root/target`` and ``root/drafter``; returns the ``models:`` section of a config for them."""
    from cluster.models.tiny import tiny_llama, truncated
    model = tiny_llama(hidden=hidden, layers=layers, heads=heads, seed=seed)
    model.save_pretrained(root / "target")
    truncated(model, 1).save_pretrained(root / "drafter")
    write_word_tokenizer(root / "target", 257)
    return {"target": {"path": str(root / "target")}, "drafter": {"path": str(root / "drafter")}}
