"""Regenerate ``specserve_pb2.py`` / ``specserve_pb2_grpc.py`` from ``specserve.proto``.

Run ``python -m protos.build`` from the repository root. The generated files are committed so a
clean clone works without this step; tests check they are up to date.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(out_dir: Path = HERE) -> list[Path]:
    from grpc_tools import protoc
    rc = protoc.main(["grpc_tools.protoc", f"-I{HERE}", f"--python_out={out_dir}",
                      f"--grpc_python_out={out_dir}", str(HERE / "specserve.proto")])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    grpc_file = out_dir / "specserve_pb2_grpc.py"
    # protoc emits `import specserve_pb2`; make it a package-relative import
    text = re.sub(r"^import specserve_pb2 as", "from . import specserve_pb2 as", grpc_file.read_text(),
                  flags=re.M)
    grpc_file.write_text(text)
    return [out_dir / "specserve_pb2.py", grpc_file]


if __name__ == "__main__":
    for p in build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(p)
