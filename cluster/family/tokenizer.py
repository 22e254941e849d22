"""The family's shared tokenizer: training a byte-level BPE (``<|endoftext|>`` as BOS/EOS/PAD) and encoding
documents into one ``EOT doc EOT doc ...`` token stream."""
from __future__ import annotations

from typing import Sequence

import torch

from cluster.family.common import _bar
from cluster.family.presets import EOT


def train_tokenizer(texts: Sequence[str], vocab_size: int, progress: bool = False):
    """Train a byte-level BPE on ``texts``; returns a ``PreTrainedTokenizerFast``.

    ``<|endoftext|>`` (id 0) is BOS/EOS/PAD; no special tokens are added on
    encode.  Offsets are untrimmed so ``return_offsets_mapping`` is exact.
    """
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with _bar(progress, total=len(texts), desc="tokenizer", unit="file") as bar:

        def it():
            for t in texts:
                yield t
                bar.update(1)

        tok.train_from_iterator(it(), trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def _encode_stream(tokenizer, texts: Sequence[str], progress: bool = False, desc: str = "encode"):
    """Token ids of ``texts`` joined as ``EOT doc EOT doc ...`` (int32 tensor)."""

    eot = tokenizer.convert_tokens_to_ids(EOT)
    backend = tokenizer.backend_tokenizer
    ids: list[int] = []
    chunk = 32
    with _bar(progress, total=len(texts), desc=desc, unit="file") as bar:
        for i in range(0, len(texts), chunk):
            for enc in backend.encode_batch(list(texts[i : i + chunk]), add_special_tokens=False):
                ids.append(eot)
                ids.extend(enc.ids)
            bar.update(len(texts[i : i + chunk]))
    ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)
