"""The embedded family's chat template: :data:`cluster.models.chat_template.CODE_CHAT_TEMPLATE` (a conversation as
Python comments, the family being trained on Python source), written as ``chat_template.jinja`` next to
every tokenizer of the family, the file transformers reads a tokenizer's template from.  The build writes it
and :func:`ensure_chat_template` adds it to a family cached before it existed (or rewrites an older version of
it: the template learnt to render tools), without retraining anything.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from cluster.models.chat_template import CODE_CHAT_TEMPLATE

TEMPLATE_FILE = "chat_template.jinja"


def ensure_chat_template(cache: Path) -> list[Path]:
    """Write the template into each tokenizer directory of ``cache`` whose template file is missing or an older
    version; returns the files written."""
    written = []
    for config in sorted(Path(cache).glob("*/tokenizer_config.json")):
        target = config.parent / TEMPLATE_FILE
        if (target.exists() and target.read_text() == CODE_CHAT_TEMPLATE) or \
                json.loads(config.read_text()).get("chat_template"):
            continue
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(CODE_CHAT_TEMPLATE)
        os.replace(tmp, target)                 # atomic: a concurrent loader sees no file or the whole one
        written.append(target)
    return written
