"""The shard's configuration: one frozen dataclass built from flags and the
environment variables the launcher sets (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardConfig:
    model_id: str | None        # None: the default model (SmolLM2-135M-Instruct)
    revision: str | None
    uds_path: str               # the shard listens on unix://{uds_path}-{rank}
    dtype: str | None           # float32 | bfloat16 | float16; None: chosen by device
    device: str | None          # cpu | cuda | cuda:N; None: cuda when available
    block_size: int
    kv_cache_bytes: int         # 0: chosen at Warmup from the device's free memory
    attention_backend: str | None
    num_threads: int            # torch intra-op threads on CPU; 0: torch's default
    quantize: str | None = None  # gptq | awq | eetq; None: config.json's quantization_config, if any
    rank: int = 0
    world_size: int = 1
    master_addr: str = "localhost"  # where rank 0 hosts the tensor-parallel rendezvous
    master_port: int = 29500
    # Decode batch sizes captured as CUDA graphs at Warmup (compiled on the
    # CPU); None: the device's default (decode_graphs.graph_batch_sizes).
    cuda_graphs: tuple[int, ...] | None = ()
    rope: tuple[str, float] | None = None  # (scaling, factor) replacing the checkpoint's RoPE scaling
    cuda_memory_fraction: float = 1.0  # of a GPU's memory the shard may hold when Warmup sizes the cache
    watermark_gamma: float = 0.5  # green share of the vocabulary for requests with watermark: true
    watermark_delta: float = 2.0  # bias added to the green logits
    lora_adapters: str | None = None  # --lora-adapters: "id,name=path,..."; None: no adapters
    kv_cache_dtype: str | None = None  # fp8_e4m3fn | fp8_e5m2: float8 KV blocks; None: the model's dtype
    speculative_model: str | None = None  # a draft model for speculation (same tokenizer); None: n-gram drafts

    @property
    def socket_path(self) -> str:
        return f"{self.uds_path}-{self.rank}"
