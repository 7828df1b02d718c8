"""Tensor parallelism's process group: the only module that calls torch.distributed.

Every rank of a shard group runs the same layers on its own slice of the
weights: row-parallel layers sum their partial outputs over the ranks
(`all_reduce_sum`), the LM head joins its vocabulary slices (`all_gather`).
At world size 1 every collective is the identity and torch.distributed is
never touched."""

import datetime

import torch
import torch.distributed as dist

# A peer that died or stopped answering makes a collective raise after this
# long instead of hanging the shard (gloo notices a closed connection at once).
COLLECTIVE_TIMEOUT_S = 60.0


class TensorParallelError(RuntimeError):
    """The shard group could not form (a peer never came, a port in use)."""


class TensorParallel:
    """This shard's place in a group of `world_size` shards.

    Contract: every rank calls the same collectives in the same order, with
    tensors of the same shape and dtype (the step, warmup and health paths
    do so by running the same forward on every rank). A collective that
    cannot complete raises RuntimeError within COLLECTIVE_TIMEOUT_S; the
    group is then unusable and the shard must be restarted.

    The default constructor is the single-shard group (rank 0 of 1)."""

    def __init__(self, rank: int = 0, world_size: int = 1, host_group: "dist.ProcessGroup | None" = None):
        self.rank, self.world_size = rank, world_size
        # Scalars the host decides on travel over gloo, so NCCL never makes
        # the host wait for the GPU; None: the default group (gloo on CPU).
        self._host_group = host_group

    @classmethod
    def connect(cls, rank: int, world_size: int, master_addr: str, master_port: int,
                device: torch.device) -> "TensorParallel":
        """Joins the group at tcp://master_addr:master_port: NCCL on CUDA
        (`device` is this rank's GPU), gloo on CPU. Blocks until every rank
        has joined; TensorParallelError after COLLECTIVE_TIMEOUT_S."""
        if world_size == 1:
            return cls()
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        backend = "nccl" if device.type == "cuda" else "gloo"
        extra = {}
        if backend == "nccl":
            torch.cuda.set_device(device)
            extra["device_id"] = device
        try:
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=rank, world_size=world_size, timeout=timeout, **extra)
            host_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
        except (RuntimeError, ValueError) as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise TensorParallelError(f"rank {rank} of {world_size} could not join the shard group at "
                                      f"{master_addr}:{master_port}: {first_line}") from None
        return cls(rank, world_size, host_group)

    def split(self, size: int) -> tuple[int, int]:
        """[start, stop) of this rank's equal share of `size` (a multiple of world_size)."""
        share = size // self.world_size
        return self.rank * share, (self.rank + 1) * share

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place; returns x."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x concatenated along `dim` in rank order (x itself at
        world size 1); x has the same shape on every rank."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._host_group)
        return int(t.item())

    def broadcast_from_first(self, values: list[int]) -> list[int]:
        """Rank 0's `values` on every rank (each rank passes as many)."""
        if self.world_size == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self._host_group)
        return t.tolist()

    def all_true(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank."""
        return self.min_over_ranks(int(ok)) == 1

    def close(self) -> None:
        """Leaves the group (a no-op at world size 1)."""
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
