"""The facts our model code needs, read once from a transformers config.

Everything that differs between the families we serve is a fact here, per
model or per layer (window, RoPE table, whether RoPE applies, whether its MLP
is a mixture of experts; models/facts.py), so one decoder (models/decoder.py)
serves them all; models/families.py says what each `model_type` sets."""

from dataclasses import dataclass

from transformers import PretrainedConfig

from ..layers.rotary import rotary_dim
from ..weights.errors import CheckpointError
from .facts import LayerFacts, MoEFacts, RopeTable
from .families import ACTIVATIONS, FAMILIES


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool       # q/k/v biases (qwen2)
    mlp_bias: bool
    layers: tuple[LayerFacts, ...]
    ropes: tuple[RopeTable, ...]
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"          # the MLP's gate: "silu" or "gelu_tanh"
    qk_norm: bool = False             # an RMSNorm over each head of q and of k, before RoPE (qwen3, gemma3)
    norm_offset: bool = False         # RMSNorm scales by 1 + weight (gemma)
    sandwich_norms: bool = False      # norms after attention and after the MLP too (gemma)
    embed_scale: float = 1.0          # embeddings times this, rounded to the weights' dtype (gemma: sqrt(hidden))
    attn_scale: float | None = None   # q.k scale; None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    attn_softcap: float = 0.0         # > 0: attention scores s become cap * tanh(s / cap) (gemma2)
    rotary_dim: int | None = None     # leading dims of a head that RoPE rotates; None: all (phi3 may rotate fewer)
    fused_qkv: bool = False           # one qkv_proj tensor holds q, k and v's rows (phi3)
    fused_gate_up: bool = False       # one gate_up_proj tensor holds gate's rows, then up's (phi3)
    moe: MoEFacts | None = None       # the experts of the layers whose LayerFacts.sparse

    @classmethod
    def from_hf(cls, hf: PretrainedConfig) -> "ModelConfig":
        model_type = getattr(hf, "model_type", None)
        family = FAMILIES.get(model_type)
        if family is None:
            raise CheckpointError(f"unsupported architecture {model_type!r}; supported: " + ", ".join(FAMILIES))
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
        if act not in family.activations:
            raise CheckpointError(f"unsupported activation {act!r} for {model_type}; supported: "
                                  + ", ".join(family.activations))
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        try:
            ropes, layer_ropes = family.ropes(hf, head_dim)
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"invalid RoPE configuration: {err}") from None
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        windows = family.windows(hf)
        rotary = rotary_dim(hf, head_dim)
        moe, sparse = family.moe(hf) if family.moe else (None, (False,) * hf.num_hidden_layers)
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=family.qkv_bias or bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            layers=tuple(LayerFacts(w, r, sp) for w, r, sp in zip(windows, layer_ropes, sparse)),
            ropes=tuple(RopeTable(tuple(inv.tolist()), scaling) for inv, scaling in ropes),
            max_position_embeddings=hf.max_position_embeddings,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            hidden_act=ACTIVATIONS[act],
            rotary_dim=None if rotary == head_dim else rotary,
            moe=moe,
            **family.extras(hf, head_dim),
        )

    def check_tensor_parallel(self, world_size: int) -> None:
        """ValueError, naming the numbers, unless the model splits over
        `world_size` shards: each rank takes an equal share of the attention
        heads and of the MLP's intermediate size; key-value heads are split
        too, or, when fewer than the shards, each is replicated on
        world_size / num_kv_heads consecutive ranks."""
        if world_size == 1:
            return
        if self.num_heads % world_size:
            raise ValueError(f"cannot shard {self.num_heads} attention heads over {world_size} shards")
        if self.num_kv_heads % world_size and world_size % self.num_kv_heads:
            raise ValueError(f"cannot shard {self.num_kv_heads} key-value heads over {world_size} shards "
                             f"(the shard count must divide them or be a multiple of them)")
        sizes = [self.intermediate_size]
        if self.moe is not None:
            sizes += [self.moe.intermediate_size, self.moe.shared_intermediate_size]
        for size in sizes:
            if size % world_size:
                raise ValueError(f"cannot shard an intermediate size of {size} over {world_size} shards")
