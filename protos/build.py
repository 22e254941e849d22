"""Regenerate ``specserve_pb2.py`` / ``specserve_pb2_grpc.py`` from ``specserve.proto``.

Run ``python -m protos.build`` from the repository root. The generated files are committed so a
clean clone works without this step; a test checks they are up to date.  The proto is compiled as
``protos/specserve.proto`` relative to the repository root, so the generated messages live in module
``protos.specserve_pb2`` (importable, hence picklable, in every Ray worker).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(out_root: Path = ROOT) -> list[Path]:
    """Compile into ``out_root/protos/``; returns the two generated files."""
    from grpc_tools import protoc
    (out_root / "protos").mkdir(parents=True, exist_ok=True)
    rc = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_root}",
                      f"--grpc_python_out={out_root}", "protos/specserve.proto"])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return [out_root / "protos" / "specserve_pb2.py", out_root / "protos" / "specserve_pb2_grpc.py"]


if __name__ == "__main__":
    for p in build(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(p)
