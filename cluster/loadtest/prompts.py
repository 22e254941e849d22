"""Prompts for a load test: the held-out set of the embedded family (as ``specserve demo`` and the
benchmarks pick them), or a file.

A file is JSON (a list of strings, or of objects with a ``prompt`` field), JSON lines (one string or object
per line, ``.jsonl``), or plain text with one prompt per non-empty line.
"""
from __future__ import annotations

import json
from pathlib import Path

from cluster.config.schema import Config
from cluster.errors import ParamError
from cluster.family.corpus import heldout_prompts
from cluster.models.build import load_tokenizer

MAX_PROMPTS = 100_000


def heldout(cfg: Config, n: int, prompt_tokens: int = 64) -> list[str]:
    """``n`` held-out prompt texts cut with ``cfg``'s tokenizer (the family must be built for a ``zoo``
    config: ``specserve zoo build``)."""
    return [p["prompt"] for p in heldout_prompts(load_tokenizer(cfg), n, prompt_tokens=prompt_tokens)]


def _text(item, where: str) -> str:
    if isinstance(item, dict):
        item = item.get("prompt")
    if not isinstance(item, str) or not item:
        raise ParamError("prompts_file", "non-empty strings or objects with a non-empty 'prompt'", f"{where}: {item!r}")
    return item


def from_file(path: str | Path) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise ParamError("prompts_file", "an existing file", str(p))
    text = p.read_text()
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ParamError("prompts_file", "valid JSON", f"{p}: {e}") from None
        if not isinstance(data, list):
            raise ParamError("prompts_file", "a JSON list of prompts", type(data).__name__)
        out = [_text(x, f"{p}[{i}]") for i, x in enumerate(data)]
    elif p.suffix == ".jsonl":
        out = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as e:
                raise ParamError("prompts_file", "one JSON value per line", f"{p}:{i}: {e}") from None
            out.append(_text(item, f"{p}:{i}"))
    else:
        out = [line for line in text.splitlines() if line.strip()]
    if not 1 <= len(out) <= MAX_PROMPTS:
        raise ParamError("prompts_file", f"1 to {MAX_PROMPTS} prompts", f"{len(out)} in {p}")
    return out
