"""The Max-Gram drafter's bigram fallback table: built from the family corpus, cached on disk."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

import cluster.family.corpus as corpus
from cluster.config.paths import default_bigram_path
from cluster.models.build import load_tokenizer
from cluster.models.maxgram import save_bigram
from cluster.models.tokenizer import ByteTokenizer


# -- bigram table -------------------------------------------------------------------------------
def build_bigram(tokenizer_or_ids, texts: Iterable[str] | None = None, vocab_size: int | None = None
                 ) -> np.ndarray:
    """Most frequent successor of every token: ``table [V] int64``.

    ``tokenizer_or_ids`` is a tokenizer (``encode(text) -> ids`` and ``vocab_size``) used on ``texts``,
    or an iterable of token-id sequences (then ``vocab_size`` is required).  Tokens never seen as a
    predecessor map to the corpus's most frequent token.
    """
    if texts is not None:
        tok = tokenizer_or_ids
        vocab_size = vocab_size or int(tok.vocab_size)
        seqs = (tok.encode(t) for t in texts)
    else:
        if vocab_size is None:
            raise ValueError("build_bigram: vocab_size is required with pre-tokenised sequences")
        seqs = tokenizer_or_ids
    V = int(vocab_size)
    codes, unigram = [], np.zeros(V, dtype=np.int64)
    for ids in seqs:
        a = np.asarray(ids, dtype=np.int64)
        if a.size == 0:
            continue
        unigram += np.bincount(a, minlength=V)[:V]
        if a.size > 1:
            codes.append(a[:-1] * V + a[1:])
    table = np.full(V, int(unigram.argmax()), dtype=np.int64)
    if codes:
        pair, count = np.unique(np.concatenate(codes), return_counts=True)
        first, second = pair // V, pair % V
        order = np.lexsort((-count, first))            # by first token, then by descending count
        first, second = first[order], second[order]
        keep = np.r_[True, first[1:] != first[:-1]]    # the most frequent successor of each token
        table[first[keep]] = second[keep]
    return table


def corpus_texts(max_chars: int) -> list[str]:
    """Training-split texts of the zoo's corpus (Python standard library), at most ``max_chars``."""
    train, _ = corpus.split_files(corpus.stdlib_files())
    out, total = [], 0
    for t in corpus.iter_texts(train):
        if total >= max_chars:
            break
        out.append(t[:max_chars - total])
        total += len(out[-1])
    return out


def ensure_bigram(cfg, *, max_chars: int | None = None) -> Path:
    """Build and cache the bigram table ``cfg`` uses (see :func:`cluster.config.paths.default_bigram_path`)
    from the family corpus's training split, unless it is already there; returns its path.  Byte-level
    (tiny) configs use a 100k-character sample, trained tokenizers 4M characters."""
    path = default_bigram_path(cfg)
    if path.is_file():
        return path
    tokenizer = load_tokenizer(cfg)
    if max_chars is None:
        max_chars = 100_000 if isinstance(tokenizer, ByteTokenizer) else 4_000_000
    table = build_bigram(tokenizer, corpus_texts(max_chars), vocab_size=tokenizer.vocab_size)
    return save_bigram(table, path)
