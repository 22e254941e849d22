"""Training / evaluation corpus: the Python standard library's own source.

The embedded model family (see :mod:`cluster.family`) is trained on the ``*.py``
files of the running interpreter's standard library.  That corpus is present on
every machine that can run this project, needs no download, is licence-clean and
is large enough (~10 MB) to train small code models in minutes.

Everything here is deterministic:

* :func:`stdlib_files` returns files in sorted order of their path relative to
  the stdlib root;
* :func:`split_files` assigns each file to train or held-out by a stable hash of
  its relative path (SHA-1, not Python's salted ``hash``), so the split does not
  depend on random state, on file order or on which other files exist;
* :func:`heldout_prompts` draws prompts with a private ``random.Random(seed)``.
"""
from __future__ import annotations

import hashlib
import random
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Sequence

__all__ = [
    "HELDOUT_FRACTION",
    "stdlib_root",
    "stdlib_files",
    "is_heldout",
    "split_files",
    "read_file",
    "iter_texts",
    "read_corpus",
    "heldout_prompts",
]


#: Approximate share of files held out from training (chosen by path hash).
HELDOUT_FRACTION = 0.04


# Directory names excluded wherever they occur in a file's relative path.
_EXCLUDED_DIRS = frozenset({"site-packages", "__pycache__", "pydoc_data"})


def stdlib_root() -> Path:
    """The directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _excluded(rel: Path) -> bool:
    """True when a stdlib-relative path must not be part of the corpus.

    Excluded: anything under ``site-packages`` (third-party code), any
    directory whose name contains ``test`` (``test/``, ``tests/``,
    ``idlelib/idle_test``, ``lib2to3/tests``, ``unittest/`` ...), ``__pycache__``,
    ``pydoc_data`` (a 750 kB generated blob of prose) and the generated
    ``_sysconfigdata_*`` modules.  (:func:`stdlib_files` additionally drops the
    machine-generated ``gencodec.py`` charmap tables in ``encodings/``.)
    """
    for part in rel.parts[:-1]:
        if part in _EXCLUDED_DIRS or "test" in part.lower():
            return True
    return rel.name.startswith("_sysconfigdata")


def _generated_table(path: Path) -> bool:
    """True for codec charmap tables written by ``gencodec.py`` (~1.2 MB of near-identical tables)."""
    with open(path, "rb") as fh:
        return b"gencodec.py" in fh.read(512)


def stdlib_files(root: Path | None = None) -> list[Path]:
    """All corpus ``*.py`` files under the stdlib (or ``root``), sorted.

    Sorting is by the POSIX form of the path relative to ``root`` so the order
    is identical across machines and file systems.
    """
    root = Path(root).resolve() if root is not None else stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if not _excluded(rel) and p.is_file() and not _generated_table(p):
            out.append(p)
    out.sort(key=lambda p: p.relative_to(root).as_posix())
    return out


def _rel_key(path: Path, root: Path | None = None) -> str:
    """Stable identifier of a file: its POSIX path relative to the stdlib root."""
    root = root if root is not None else stdlib_root()
    path = Path(path)
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:  # a file outside the stdlib: fall back to its own path
        return path.as_posix()


def is_heldout(path: Path, fraction: float = HELDOUT_FRACTION, root: Path | None = None) -> bool:
    """Whether ``path`` belongs to the held-out split (stable SHA-1 of its relative path)."""
    digest = hashlib.sha1(_rel_key(path, root).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


def split_files(
    files: Sequence[Path], fraction: float = HELDOUT_FRACTION, root: Path | None = None
) -> tuple[list[Path], list[Path]]:
    """Split ``files`` into ``(train, heldout)``; both keep the input order.

    Membership depends only on each file's relative path, so it is the same on
    every run and every machine with the same stdlib layout.
    """
    train: list[Path] = []
    held: list[Path] = []
    for f in files:
        (held if is_heldout(f, fraction, root) else train).append(f)
    return train, held


def read_file(path: Path) -> str:
    """Read one source file as UTF-8 (undecodable bytes replaced), newlines normalised."""
    text = Path(path).read_bytes().decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def iter_texts(files: Iterable[Path]) -> Iterator[str]:
    """Yield the text of each non-empty file in order."""
    for f in files:
        t = read_file(f)
        if t.strip():
            yield t


def read_corpus(files: Iterable[Path], max_chars: int | None = None, sep: str = "\n\n") -> str:
    """Concatenate the files' texts with ``sep``; truncate to ``max_chars`` if given."""
    parts: list[str] = []
    total = 0
    for t in iter_texts(files):
        parts.append(t)
        total += len(t) + len(sep)
        if max_chars is not None and total >= max_chars:
            break
    text = sep.join(parts)
    return text[:max_chars] if max_chars is not None else text


def _encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def heldout_prompts(
    tokenizer,
    n: int,
    prompt_tokens: int = 64,
    continuation_tokens: int = 64,
    seed: int = 0,
    files: Sequence[Path] | None = None,
) -> list[dict]:
    """Cut ``n`` evaluation prompts from the held-out files.

    Each item is ``{"prompt": str, "prompt_ids": list[int], "reference": str,
    "source": str}``.  A prompt starts at the beginning of a (non-blank) line,
    spans about ``prompt_tokens`` tokens and, where possible, ends at a line
    boundary (it is never shorter than half of ``prompt_tokens`` unless the cut
    has to fall mid-line).  ``reference`` is the file's true continuation right
    after the prompt, about ``continuation_tokens`` tokens long; it is meant as
    the reference text for chrF scoring.  ``prompt_ids`` is
    ``tokenizer(prompt, add_special_tokens=False).input_ids``; no BOS is added.

    Files too short to hold prompt + continuation are skipped.  The result
    depends only on the tokenizer, the held-out files and ``seed``.
    ``tokenizer`` must be a *fast* tokenizer (offset mappings are used).
    """
    if n <= 0:
        return []
    if files is None:
        _, files = split_files(stdlib_files())
    need = prompt_tokens + continuation_tokens
    docs = []  # (rel, text, candidate line-start character offsets)
    for f in files:
        text = read_file(f)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) < need + 1:
            continue  # too short for even one prompt + continuation
        starts, pos = [], 0
        for line in text.splitlines(keepends=True):
            if line.strip():
                starts.append(pos)
            pos += len(line)
        if starts:
            docs.append((_rel_key(f), text, starts))
    if not docs:
        raise ValueError("no held-out file is long enough for the requested prompt size")

    rng = random.Random(seed)
    out: list[dict] = []
    seen: set[tuple[str, int]] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 1000 * n:
            raise RuntimeError("could not draw enough distinct held-out prompts")
        rel, text, starts = docs[rng.randrange(len(docs))]
        c0 = starts[rng.randrange(len(starts))]
        if (rel, c0) in seen and attempts < 50 * n:
            continue
        # tokenise from the line start; 32 chars/token is a generous upper bound
        window = text[c0 : c0 + 32 * need]
        ids, offs = _encode_with_offsets(tokenizer, window)
        if len(ids) < need:
            continue  # too close to the end of the file
        seen.add((rel, c0))
        # prefer ending the prompt right after a newline, keeping >= half the tokens
        end = prompt_tokens  # exclusive token index
        for j in range(prompt_tokens, max(1, prompt_tokens // 2), -1):
            e = offs[j - 1][1]
            if e > 0 and window[e - 1] == "\n":
                end = j
                break
        p_end = offs[end - 1][1]
        r_end = offs[end + continuation_tokens - 1][1]
        prompt = window[:p_end]
        out.append(
            {
                "prompt": prompt,
                "prompt_ids": list(tokenizer(prompt, add_special_tokens=False)["input_ids"]),
                "reference": window[p_end:r_end],
                "source": rel,
            }
        )
    return out
