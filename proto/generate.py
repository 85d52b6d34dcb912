"""Regenerate the Python modules of `pipeline.proto`.

    python proto/generate.py

The modules are committed; `tests/test_proto.py` fails when they no longer
match the `.proto` file.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTPUTS = ("pipeline_pb2.py", "pipeline_pb2.pyi", "pipeline_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Write the generated modules for `proto/pipeline.proto` into `out_dir`."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        # Map the file to its import path, mlxpipe/proto/pipeline.proto, so the
        # generated gRPC module imports `mlxpipe.proto.pipeline_pb2`.
        args = [
            "protoc",
            f"-Imlxpipe/proto={HERE}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(HERE / "pipeline.proto"),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        for name in OUTPUTS:
            shutil.copy(Path(tmp, "mlxpipe", "proto", name), out_dir / name)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
