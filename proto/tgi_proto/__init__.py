"""Generated router <-> shard contract (see proto/generate.proto)."""

from . import generate_pb2 as pb
from . import generate_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
