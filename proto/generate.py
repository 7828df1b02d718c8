"""Regenerates the gRPC code in proto/tgi_proto/ from proto/generate.proto.

Usage: python proto/generate.py [OUT_DIR]   (default: proto/tgi_proto)

grpc_tools writes `import generate_pb2` in the service module; the import is
rewritten to a relative one so the code lives inside the `tgi_proto` package.
"""

import re
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    code = protoc.main([
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / "generate.proto"),
    ])
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    service = out_dir / "generate_pb2_grpc.py"
    text = re.sub(r"^import generate_pb2 as", "from . import generate_pb2 as",
                  service.read_text(), flags=re.M)
    service.write_text(text)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR / "tgi_proto")
