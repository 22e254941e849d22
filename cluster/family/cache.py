"""The family's on-disk cache: reading and validating ``manifest.json``, looking up model entries, and the
file lock that serialises builds."""
from __future__ import annotations

import contextlib
import fcntl
import json
from pathlib import Path

from cluster.config.paths import ZOO_VERSION, default_cache_dir


def load_manifest(cache_dir: Path | str | None = None) -> dict | None:
    """The manifest of a complete build in ``cache_dir``, or ``None``.

    ``None`` when the manifest is missing, unreadable, of another zoo version, or
    when a model directory it lists is missing.  Each model entry's ``path`` is
    returned as an absolute path under ``cache_dir`` (the file stores it
    relative, so the cache can be moved).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache_dir / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("zoo_version") != ZOO_VERSION:
        return None
    for m in manifest.get("models", []):
        d = (cache_dir / m["dir"]).resolve()
        if not (d / "config.json").is_file():
            return None
        m["path"] = str(d)
    manifest["cache_dir"] = str(cache_dir.resolve())
    tok = manifest.get("tokenizer", {})
    if "dir" in tok:
        tok["path"] = str((cache_dir / tok["dir"]).resolve())
    return manifest


@contextlib.contextmanager
def _build_lock(cache_dir: Path):
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_dir.parent / f".{cache_dir.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
