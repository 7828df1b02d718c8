"""Regenerates the message code in proto/tgi_proto/ from proto/generate.proto
(protoc from grpc_tools; the service is carried by tgi_proto/rpc.py).

Usage: python proto/generate.py [OUT_DIR]   (default: proto/tgi_proto)
"""

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
        str(PROTO_DIR / "generate.proto"),
    ])
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR / "tgi_proto")
