"""The draft verifiers by name (``--verify``), built from both verification modules.

Each maps ``(draft [L], q [L, V], p [L+1, V], rng) -> Verdict`` (see :mod:`cluster.core.verify`).
"""
from __future__ import annotations

from cluster.core.block_verify import verify_block
from cluster.core.verify import verify_tokens

VERIFIERS = {"token": verify_tokens, "block": verify_block}
