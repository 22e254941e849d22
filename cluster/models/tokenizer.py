"""Tokenizers the engine uses: HF tokenizers from a checkpoint dir, or raw bytes for tiny models.

Each also streams (:class:`cluster.core.interfaces.TextStream`): incremental detokenisation that decodes
each token once, through the tokenizers library's ``DecodeStream`` or the standard library's incremental
UTF-8 decoder, so a stream's text costs time linear in its length.
"""
from __future__ import annotations

import codecs
from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 plus an end-of-text token 256 (used by the tiny test models)."""

    vocab_size = 257
    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def stream(self) -> "ByteStream":
        return ByteStream()

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
        self.path = str(path)                   # where another process loads it again (grammars: models/grammar.py)
        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.tok.model_max_length = 1 << 40     # lengths are checked against the model by the engine
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def stream(self) -> "HFStream":
        return HFStream(self.tok.backend_tokenizer)

    def __call__(self, text: str, **kwargs):
        """The Hugging Face call convention, delegated (offset mappings included): the family's held-out
        prompts (:func:`cluster.family.corpus.heldout_prompts`) cut text at token boundaries with it."""
        return self.tok(text, **kwargs)


class ByteStream:
    """Byte tokens through the standard library's incremental UTF-8 decoder (``errors="replace"``, as
    :meth:`ByteTokenizer.decode`); ids outside 0..255 (end of text) decode to nothing."""

    def __init__(self):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        return self._utf8.decode(bytes((token_id,))) if 0 <= token_id < 256 else ""

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class HFStream:
    """The tokenizers library's ``DecodeStream`` (skipping special tokens, as :meth:`HFTokenizer.decode`):
    it decodes a small window of ids per token and returns text only once it does not end in an incomplete
    character (multi-byte UTF-8, byte-fallback tokens).

    ``DecodeStream`` cannot say what it holds back, so :meth:`flush` decodes the held ids itself, after the
    ids of the last text for context (decoders such as Metaspace's strip a leading space only at the start).
    Where a decoder is not local, text already emitted stays: a ByteFallback run that is not valid UTF-8
    decodes in ``decode`` to one U+FFFD per byte of the whole run, valid characters before it included,
    and ``DecodeStream`` raises on it; the stream then emits the new ids' own text and starts afresh after
    them, so the streamed text keeps the valid characters and differs from ``decode`` only there."""

    def __init__(self, backend):
        from tokenizers.decoders import DecodeStream
        self._new = lambda ids=None: DecodeStream(ids, skip_special_tokens=True)
        self._backend, self._stream = backend, self._new()
        self._held: list[int] = []         # ids since the stream last returned text
        self._context: list[int] = []      # the ids that completed the last text

    def step(self, token_id: int) -> str:
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception:                  # noqa: BLE001 - tokenizers raises a bare Exception ("Invalid prefix")
            text = self._after_context(self._held + [token_id])
            self._stream = self._new(self._held + [token_id])
        if text is None:
            self._held.append(token_id)
            return ""
        self._context, self._held = self._held + [token_id], []
        return text

    def flush(self) -> str:
        held, self._held = self._held, []
        return self._after_context(held) if held else ""

    def _after_context(self, ids: list[int]) -> str:
        """The text of ``ids`` as it continues the last text (or alone, where decoding is not local)."""
        decode = lambda x: self._backend.decode(x, skip_special_tokens=True)
        head, full = decode(self._context), decode(self._context + ids)
        return full[len(head):] if full.startswith(head) else decode(ids)
