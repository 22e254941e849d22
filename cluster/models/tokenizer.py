"""Tokenizers the engine uses: HF tokenizers from a checkpoint dir, or raw bytes for tiny models."""
from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 plus an end-of-text token 256 (used by the tiny test models)."""

    vocab_size = 257
    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __call__(self, text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = False):
        """The Hugging Face call convention (``input_ids``, optional character ``offset_mapping``)."""
        ids, offsets = [], []
        for pos, ch in enumerate(text):
            b = ch.encode("utf-8")
            ids.extend(b)
            offsets.extend([(pos, pos + 1)] * len(b))
        return {"input_ids": ids, "offset_mapping": offsets} if return_offsets_mapping else {"input_ids": ids}


class HFTokenizer:
    """Adapter over ``transformers.AutoTokenizer`` loaded from a local directory."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.tok.model_max_length = 1 << 40     # lengths are checked against the model by the engine
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def __call__(self, text: str, **kwargs):
        """The Hugging Face call convention, delegated (offset mappings included)."""
        return self.tok(text, **kwargs)
