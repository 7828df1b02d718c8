"""A request's state as the router tracks it. The sequence owns its token
ids, its computed-token count and its block table; nothing else stores
per-request token state."""

from dataclasses import dataclass, field
from enum import Enum

from tgi_proto import pb
from tgi_router.scheduling.block_manager import ROOT_HASH


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(Enum):
    """Why a sequence ended. The first three are TGI's and reach clients;
    CANCELLED (its client hung up, or its request failed) never does: the
    engine drops a cancelled request's stream before any result is built."""
    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class StoppingCriteria:
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclass
class Sequence:
    id: int
    token_ids: list[int]
    params: pb.SamplingParameters
    stopping: StoppingCriteria
    prompt_length: int = 0
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    # What the shards already know, so a step sends only the difference: whether
    # they hold the sequence (they append the tokens they sample themselves),
    # and how many of its blocks.
    on_shard: bool = False
    shard_blocks: int = 0
    # Prefix hashes of the first full blocks of token_ids (filled lazily by
    # the scheduler); they depend on the tokens and the adapter only, so
    # they outlive preemption.
    block_hashes: list[int] = field(default_factory=list)
    adapter: int = 0  # 0: the base model; i > 0: the shards' i-th LoRA adapter (Info.adapter_ids)
    # Speculation: decayed counts of this sequence's drafts accepted and
    # checked (a rejection ends a check), for SpeculationPolicy.rate.
    draft_accepted: float = 0.0
    draft_checked: float = 0.0
    steps_undrafted: int = 0  # decode steps since the policy last allowed it a draft

    def __post_init__(self):
        self.prompt_length = self.prompt_length or len(self.token_ids)

    @property
    def hash_root(self) -> int:
        """The parent hash of the first block: the adapter's own."""
        return hash(("lora", self.adapter)) if self.adapter else ROOT_HASH

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_length

    @property
    def remaining(self) -> int:
        """The one accounting rule: tokens still to compute."""
        return len(self.token_ids) - self.num_computed

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.prompt_length:]
