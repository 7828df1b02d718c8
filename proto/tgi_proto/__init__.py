"""Generated router <-> shard messages (see proto/generate.proto) and their
transport (rpc.py)."""

from . import generate_pb2 as pb

__all__ = ["pb"]
