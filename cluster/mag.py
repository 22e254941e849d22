"""The Max-Gram (MaG) drafter: a statistical language model that costs (almost) nothing to run.

Paper 002 (Chen et al., *Cascade Speculative Drafting*), section 3.3 and appendix A: find the longest
suffix of the current sequence (prompt + generated) that occurred earlier in it and copy the tokens
that followed that occurrence; where that yields fewer than k tokens, continue greedily from a bigram
table (each token's most frequent successor in a corpus).

Unlike the paper's listing (a rescan of the whole sequence per call), :class:`MaxGramIndex` keeps an
incremental index: a dict from every n-gram (n <= ``max_ngram``) to the end positions where it
occurs, updated per appended token in O(max_ngram) and undone per removed token on rollback.  The
longest earlier match is then a binary search over n (if a suffix of length n occurred earlier, so did
its suffix of length n - 1), so a proposal costs O(log(max_ngram) * max_ngram + k * max_ngram)
independent of the context length.  Among several earlier occurrences of the longest suffix, the
*most recent* one is copied (the paper's listing takes the first; recent context predicts better).

:class:`MagHandle` exposes MaG through the :class:`cluster.model.ModelHandle` interface, so a
strategy treats it like any drafter: its proposals come with one-hot "distributions" (logits 0 for
the proposed token, -inf elsewhere), so verification against it is exact speculative sampling with a
deterministic drafter (accept x w.p. min(1, p(x)), recover from norm(max(0, p - onehot(x)))).
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from .sampling import SamplingParams

DEFAULT_MAX_NGRAM = 24
BIGRAM_FILE = "bigram.npy"


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


def save_bigram(table: np.ndarray, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, np.asarray(table, dtype=np.int32))
    tmp.replace(path)
    return path


def load_bigram(path: str | Path) -> np.ndarray:
    return np.load(Path(path)).astype(np.int64)


# -- the incremental index ----------------------------------------------------------------------
class MaxGramIndex:
    """Token sequence plus an index of n-gram -> end positions (ascending), n <= ``max_ngram``.

    Invariant: the index holds exactly the n-grams ending at positions ``<= len(seq) - 2``, so any hit
    for a suffix of the sequence is an *earlier* occurrence (never the suffix itself).
    """

    def __init__(self, ids: Sequence[int] = (), max_ngram: int = DEFAULT_MAX_NGRAM):
        self.max_ngram = max_ngram
        self.seq: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = {}
        self.extend(ids)

    def __len__(self) -> int:
        return len(self.seq)

    def _index_end(self, e: int) -> None:
        seq, table = self.seq, self.table
        for n in range(1, min(self.max_ngram, e + 1) + 1):
            key = tuple(seq[e - n + 1:e + 1])
            hit = table.get(key)
            if hit is None:
                table[key] = [e]
            else:
                hit.append(e)

    def _unindex_end(self, e: int) -> None:
        seq, table = self.seq, self.table
        for n in range(1, min(self.max_ngram, e + 1) + 1):
            key = tuple(seq[e - n + 1:e + 1])
            hit = table[key]
            hit.pop()                               # e is the largest indexed end: the list's last
            if not hit:
                del table[key]

    def append(self, tok: int) -> None:
        self.seq.append(int(tok))
        if len(self.seq) >= 2:
            self._index_end(len(self.seq) - 2)

    def extend(self, ids: Iterable[int]) -> None:
        for t in ids:
            self.append(t)

    def truncate(self, length: int) -> None:
        """Drop tokens from position ``length`` on (undoing their index entries)."""
        length = max(0, length)
        while len(self.seq) > length:
            if len(self.seq) >= 2:
                self._unindex_end(len(self.seq) - 2)
            self.seq.pop()

    def longest_match(self) -> tuple[int, int]:
        """(n, e): the longest suffix length n that also ends at an earlier position, and the latest
        such end position e (``<= len - 2``); (0, -1) when even the last token never occurred before."""
        seq, table = self.seq, self.table
        N = len(seq)
        lo, hi, best = 1, min(self.max_ngram, N - 1), (0, -1)
        while lo <= hi:                              # monotone: a match of n implies one of n - 1
            mid = (lo + hi) // 2
            hit = table.get(tuple(seq[N - mid:]))
            if hit is None:
                hi = mid - 1
            else:
                best, lo = (mid, hit[-1]), mid + 1
        return best

    def predict(self, k: int, bigram: np.ndarray | None) -> list[int]:
        """k draft tokens: copy what followed the longest earlier match, then bigram continuation."""
        if k <= 0 or not self.seq:
            return []
        n, e = self.longest_match()
        out = self.seq[e + 1:e + 1 + k] if n > 0 else []
        last = out[-1] if out else self.seq[-1]
        while len(out) < k:
            last = int(bigram[last]) if bigram is not None and 0 <= last < len(bigram) else last
            out.append(last)
        return out


def brute_force_predict(seq: Sequence[int], k: int, bigram: np.ndarray | None,
                        max_ngram: int = DEFAULT_MAX_NGRAM) -> list[int]:
    """Reference implementation of :meth:`MaxGramIndex.predict` by rescanning (for the tests)."""
    seq = list(seq)
    N = len(seq)
    if k <= 0 or N == 0:
        return []
    out: list[int] = []
    for n in range(min(max_ngram, N - 1), 0, -1):
        ends = [e for e in range(n - 1, N - 1) if seq[e - n + 1:e + 1] == seq[N - n:]]
        if ends:
            e = ends[-1]
            out = seq[e + 1:e + 1 + k]
            break
    last = out[-1] if out else seq[-1]
    while len(out) < k:
        last = int(bigram[last]) if bigram is not None and 0 <= last < len(bigram) else last
        out.append(last)
    return out


# -- MaG as a model handle ----------------------------------------------------------------------
class MagHandle:
    """The MaG drafter behind the :class:`cluster.model.ModelHandle` interface.

    ``propose`` returns one-hot logits ``[k, V]`` (0 at the proposed token, -inf elsewhere) so the
    core verifies against a deterministic drafter; ``score`` returns MaG's one-hot prediction at each
    of the L+1 positions (MaG as a deterministic "model").  ``num_params`` is the bigram table size
    (paper 002, section 5.2: "a bigram model with parameters equal to the tokenizer size"), so the
    standardized walltime improvement charges it (almost) nothing.
    """

    def __init__(self, vocab_size: int, bigram: np.ndarray | None = None, *, name: str = "mag",
                 max_ngram: int = DEFAULT_MAX_NGRAM, max_length: int = 1 << 30):
        self.name, self.vocab_size, self.max_length = name, int(vocab_size), max_length
        self.bigram = None if bigram is None else np.asarray(bigram, dtype=np.int64)
        if self.bigram is not None and (len(self.bigram) != self.vocab_size or
                                        (self.bigram.size and (self.bigram.min() < 0 or
                                                               self.bigram.max() >= self.vocab_size))):
            raise ValueError(f"mag: bigram table of {len(self.bigram)} entries does not match "
                             f"vocabulary size {self.vocab_size}")
        self.num_params = self.vocab_size
        self.max_ngram = max_ngram
        self._requests: dict[str, MaxGramIndex] = {}

    def _onehot(self, toks: list[int]) -> torch.Tensor:
        logits = torch.full((len(toks), self.vocab_size), float("-inf"))
        if toks:
            logits[torch.arange(len(toks)), torch.tensor(toks)] = 0.0
        return logits                                                  # [n, V]

    def _get(self, rid: str) -> MaxGramIndex:
        try:
            return self._requests[rid]
        except KeyError:
            raise KeyError(f"{self.name}: unknown request {rid!r}") from None

    def prefill(self, rid: str, ids: list[int], sampling: SamplingParams | None = None, seed: int = 0) -> None:
        if not ids:
            raise ValueError("prefill needs at least one token")
        self._requests[rid] = MaxGramIndex(ids, self.max_ngram)

    def propose(self, rid: str, k: int) -> tuple[list[int], torch.Tensor]:
        idx = self._get(rid)
        toks = idx.predict(k, self.bigram)
        idx.extend(toks)
        return toks, self._onehot(toks)                                # [k], [k, V]

    def score(self, rid: str, draft: list[int]) -> torch.Tensor:
        idx = self._get(rid)
        preds = [idx.predict(1, self.bigram)[0]]
        for t in draft:
            idx.append(t)
            preds.append(idx.predict(1, self.bigram)[0])
        return self._onehot(preds)                                     # [L+1, V]

    def rollback(self, rid: str, length: int) -> None:
        self._get(rid).truncate(length)

    def extend(self, rid: str, ids: list[int]) -> None:
        self._get(rid).extend(ids)

    def release(self, rid: str) -> None:
        self._requests.pop(rid, None)

    def length(self, rid: str) -> int:
        return len(self._get(rid))

    def active_requests(self) -> list[str]:
        return list(self._requests)


def proposal_latency(handle: MagHandle, sizes: Sequence[int] = (256, 1024, 4096), k: int = 8,
                     iters: int = 200, seed: int = 0) -> dict[int, float]:
    """Median microseconds of one ``propose(k)`` + ``rollback`` at each context length (random
    repetitive token sequences, so matches are found)."""
    rng = np.random.default_rng(seed)
    out = {}
    for n in sizes:
        base = rng.integers(0, handle.vocab_size, size=max(8, n // 8)).tolist()
        ids = (base * (n // len(base) + 1))[:n]
        for i in range(0, n, 7):                       # perturb so matches have varying lengths
            ids[i] = int(rng.integers(0, handle.vocab_size))
        rid = f"latency-{n}"
        handle.prefill(rid, ids)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            handle.propose(rid, k)
            handle.rollback(rid, n)
            times.append(time.perf_counter() - t0)
        handle.release(rid)
        out[n] = float(np.median(times) * 1e6)
    return out


# -- where the bigram table of a configuration lives ---------------------------------------------
def default_bigram_path(cfg) -> Path | None:
    """The bigram file the loader uses for ``cfg`` (``None``: build in memory, for tiny configs).

    ``cfg.mag.bigram`` if set; for the embedded family ``<zoo cache>/mag/bigram.npy``; for a ``path``
    target ``~/.cache/specserve/mag/<hash of the checkpoint path>.npy``.
    """
    if getattr(cfg, "mag", None) is not None and cfg.mag.bigram:
        return Path(cfg.mag.bigram).expanduser()
    spec = cfg.models[cfg.target]
    if spec.zoo is not None:
        from .loader import zoo_dir
        return zoo_dir(cfg) / "mag" / BIGRAM_FILE
    if spec.path is not None:
        from . import zoo
        h = hashlib.sha1(str(Path(spec.path).expanduser().resolve()).encode()).hexdigest()[:12]
        return zoo.default_cache_dir().parent / "mag" / f"bigram-{h}.npy"
    return None


def corpus_texts(max_chars: int) -> list[str]:
    """Training-split texts of the zoo's corpus (Python standard library), at most ``max_chars``."""
    from . import corpus
    train, _ = corpus.split_files(corpus.stdlib_files())
    out, total = [], 0
    for t in corpus.iter_texts(train):
        if total >= max_chars:
            break
        out.append(t[:max_chars - total])
        total += len(out[-1])
    return out


def bigram_for(cfg, tokenizer, vocab_size: int | None = None, *, max_chars: int = 4_000_000,
               build: bool = True) -> np.ndarray:
    """The bigram table for ``cfg`` (built from the zoo's training corpus and cached if missing)."""
    path = default_bigram_path(cfg)
    if path is not None and path.is_file():
        return load_bigram(path)
    if not build:
        raise FileNotFoundError(f"no MaG bigram table at {path}: run `specserve mag build-bigram`")
    table = build_bigram(tokenizer, corpus_texts(max_chars if path is not None else 100_000),
                         vocab_size=vocab_size or tokenizer.vocab_size)
    if path is not None:
        save_bigram(table, path)
    return table
