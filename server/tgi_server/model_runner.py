"""One shard's engine: sequence state, KV cache, forward pass and sampling.

Under tensor parallelism every rank applies every step (sequence table, its
slice of the KV cache, the forward with its collectives); rank 0 alone
samples, and the router reads rank 0's answers only. Warmup, Health and Step
run the same collectives in the same order on every rank; Info, Release and
ClearCache run none.

Not thread-safe: the service calls it from one thread, one call at a time."""

import logging
import math
import time

import torch

from tgi_kernels import FP8_KV_DTYPES, SOFTCAP_BACKENDS, select_backend
from tgi_proto import pb

from .batch import StepBatch, build_batch
from .decode_graphs import DecodeGraphs, backend_supports_graphs, compile_available, graph_batch_sizes
from .generations import generations as generations_of
from .kv_cache import KVCache, KVCacheSpec
from .layers.attention import ForwardContext
from .memory import kv_cache_budget
from .model_loader import LoadedModel
from .sampling.grammar import GrammarCompiler
from .sampling.sampler import Sampler
from .sampling.watermark import Watermark
from .sequences import SequenceTable, ShardSequence
from .speculation.draft_model import DraftModel
from .speculation.medusa import MedusaHeads

log = logging.getLogger("tgi_server")


class ModelRunner:
    """grammars: compiles the grammars of constrained requests; None when the
    shard has no tokenizer (a grammar is then an invalid step) and on ranks
    > 0, which do not sample. cuda_graphs: decode batch sizes to capture at
    Warmup (CUDA graphs on CUDA, compiled forwards on the CPU; None: the
    device's default). memory_fraction: the share of a
    GPU's memory the shard may hold when Warmup sizes the cache itself
    (--cuda-memory-fraction). watermark: gamma and delta for requests that
    ask for the watermark (None: TGI's defaults). kv_cache_dtype: the KV
    blocks' dtype (a float8 one: --kv-cache-dtype; None: the model's).
    draft: the model that proposes drafts (--speculative-model; None:
    n-gram lookup), built by `attach_draft`."""

    def __init__(self, loaded: LoadedModel, block_size: int, attention_backend: str | None,
                 kv_cache_bytes: int, grammars: GrammarCompiler | None = None,
                 cuda_graphs: tuple[int, ...] | None = (), memory_fraction: float = 1.0,
                 watermark: Watermark | None = None, kv_cache_dtype: torch.dtype | None = None):
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.tp = loaded.tp
        self.adapters = loaded.adapters
        self.is_sampling_rank = self.tp.rank == 0
        self.block_size = block_size
        self.backend = select_backend(self.device, attention_backend, fp8_kv=kv_cache_dtype in FP8_KV_DTYPES)
        if self.config.attn_softcap and self.backend not in SOFTCAP_BACKENDS:
            raise ValueError(f"the {self.backend} attention backend cannot cap attention scores "
                             f"(this {self.config.model_type} model does); use one of {', '.join(SOFTCAP_BACKENDS)}")
        self.kv_cache_bytes = kv_cache_bytes  # the shard's flag, per rank; 0 = automatic
        self.memory_fraction = memory_fraction  # of a GPU's memory the shard may hold (automatic budget)
        self.sampler = Sampler(watermark)
        self.grammars = grammars
        self.kv_spec = KVCacheSpec(self.config.num_layers, self.model.heads.num_kv_heads,
                                   self.config.head_dim, block_size, kv_cache_dtype or loaded.dtype)
        # Until Warmup sizes it, the cache holds only the scratch block.
        self.cache = KVCache(self.kv_spec, 0, self.device)
        self.table = self._table(0)
        self.warmed_up = False
        self.cuda_graph_sizes = cuda_graphs
        self.graphs: DecodeGraphs | None = None  # captured at Warmup, once the cache is final
        # The most torch threads the shard runs (the thread governor may lower
        # the count under load, never raise it past this): compiled decode
        # steps are compiled for it.
        self.max_threads = torch.get_num_threads()
        self.draft: DraftModel | None = None
        self.medusa: MedusaHeads | None = None  # the checkpoint's Medusa heads (set before Warmup)

    def attach_draft(self, loaded: LoadedModel, kv_cache_dtype: torch.dtype | None = None) -> None:
        """Drafts from now on come from `loaded` (the target's device, dtype
        and group), its K/V in a cache beside the target's, before Warmup."""
        self.draft = DraftModel(loaded, self.block_size, self.backend, self.config.vocab_size, kv_cache_dtype)

    def _table(self, num_blocks: int) -> SequenceTable:
        return SequenceTable(self.block_size, num_blocks, self.config.vocab_size, self.grammars, self.is_sampling_rank)

    # -- warmup and health -------------------------------------------------
    def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        """Runs the largest prefill and decode steps on the scratch block, then
        allocates the KV cache from the memory budget (per rank); every rank
        of a group takes the smallest rank's number of blocks."""
        start = time.perf_counter_ns()
        self.table.clear()
        self.graphs = None  # they hold the old cache's tensors
        self.cache = KVCache(self.kv_spec, 0, self.device)
        prefill_tokens = max(1, request.max_batch_prefill_tokens or 4096)
        batch_size = max(1, min(request.max_batch_size or 256, prefill_tokens))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        self.run_scratch(prefill_tokens, min(batch_size, 8), decode=False)
        self.run_scratch(batch_size, batch_size, decode=True)
        budget = (request.kv_cache_bytes or self.kv_cache_bytes
                  or kv_cache_budget(self.device, self.tp.world_size, self.memory_fraction))
        # A block holds its tokens' K/V in the target's cache and, with a draft model, in the draft's.
        per_block = self.kv_spec.bytes_per_block + (self.draft.kv_spec.bytes_per_block if self.draft else 0)
        num_blocks = int(max(1, budget // per_block - 1))  # one block stays the scratch block
        num_blocks = self.tp.min_over_ranks(num_blocks)
        self.cache = KVCache(self.kv_spec, num_blocks, self.device)
        if self.draft is not None:
            self.draft.allocate(num_blocks)
        self.table = self._table(num_blocks)
        self.graphs = self._capture_graphs(batch_size)
        self.warmed_up = True
        return pb.WarmupResponse(
            num_blocks=num_blocks, block_size=self.block_size,
            kv_cache_bytes=self.cache.nbytes + (self.draft.cache.nbytes if self.draft else 0),
            max_supported_total_tokens=num_blocks * self.block_size,
            warmup_ns=time.perf_counter_ns() - start)

    def _capture_graphs(self, max_batch_size: int) -> DecodeGraphs | None:
        """Decode steps for the requested sizes: CUDA graphs on CUDA with a
        backend that suits them, compiled forwards on the CPU with our C++
        kernels (decode_graphs.py); None where neither applies."""
        sizes = graph_batch_sizes(self.cuda_graph_sizes, max_batch_size, self.device)
        if self.device.type not in ("cuda", "cpu") or not sizes:
            return None
        what = "CUDA graphs" if self.device.type == "cuda" else "compiled decode steps"
        if self.adapters is not None:
            log.info("%s off: LoRA layers group each step's tokens by adapter on the host", what)
            return None
        if self.config.moe is not None:
            log.info("%s off: mixture-of-experts blocks read how many tokens each expert got "
                     "on the host, which a graph cannot replay", what)
            return None
        if self.device.type == "cuda":
            if not backend_supports_graphs(self.backend, self.block_size):
                log.info("CUDA graphs off: the %s backend (block size %d) gathers whole block tables",
                         self.backend, self.block_size)
                return None
        else:
            why = compile_available()
            if self.backend != "cpu":
                why = f"the {self.backend} attention backend (only our C++ kernels' is compiled)"
            elif self.tp.world_size > 1:
                why = "tensor parallelism (its collectives are not compiled)"
            if why:
                log.info("compiled decode steps off: %s", why)
                return None
        # The widest table a sequence can have: the model's context or the whole cache.
        max_tokens = min(self.config.max_position_embeddings, self.cache.num_blocks * self.block_size)

        def logits(input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
            normed = self.model.final_hidden(self.model(input_ids, ctx), None)
            out = self.model.lm_head(normed)  # [B, vocab] float32
            # With Medusa heads, the normed hidden states ride along: [B, vocab + hidden].
            return out if self.medusa is None else torch.cat([out, normed.float()], dim=1)

        start = time.perf_counter()
        if self.device.type == "cpu":
            log.info("compiling decode steps for batch sizes %s (~10 s each the first time, then cached)",
                     list(sizes))
        try:
            with torch.inference_mode():
                graphs = DecodeGraphs(logits, self.cache.layers, self.backend, self.block_size,
                                      math.ceil(max_tokens / self.block_size), self.cache.scratch_block,
                                      sizes, self.device, mode="capture" if self.device.type == "cuda" else "compile",
                                      threads=self.max_threads)
        except Exception as err:  # inductor without a working compiler, an op it cannot trace
            if self.device.type == "cuda":
                raise
            log.warning("compiled decode steps off, decoding eagerly: %s: %s", type(err).__name__,
                        str(err).strip().splitlines()[0] if str(err).strip() else "")
            return None
        log.info("%s for decode batch sizes %s in %.1f s", "captured CUDA graphs" if self.device.type == "cuda"
                 else what, list(sizes), time.perf_counter() - start)
        return graphs

    def _batch(self, seqs: list[ShardSequence]) -> StepBatch:
        """The step's inputs: on the host for a pure decode step that a graph
        will replay (DecodeGraphs sends them in two copies), else on the device."""
        if self.graphs is not None and all(s.scheduled == 1 + s.drafted for s in seqs):
            batch = build_batch(seqs, self.block_size, torch.device("cpu"))
            return batch if self.graphs.can_run(batch) else batch.to(self.device)
        return build_batch(seqs, self.block_size, self.device)

    def logits(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [S, vocab] float32 of batch.logits_rows, and with Medusa heads
        their normed hidden states [S, hidden], else None): a graph replay
        when one fits, else an eager forward under `context(batch)`."""
        if self.adapters is not None:
            self.adapters.set_segments(batch.lora_segments)
        if self.graphs is not None and self.graphs.can_run(batch):
            out = self.graphs.run(batch)  # every decode row's, [n, vocab (+ hidden)]
            # logits_rows are ascending and distinct: as many as rows means all of them.
            rows = batch.logits_rows
            out = out if len(rows) == len(out) else out.index_select(0, rows.to(out.device))
            if self.medusa is None:
                return out, None
            vocab = out.shape[1] - self.config.hidden_size
            return out[:, :vocab], out[:, vocab:].clone()  # the graph's buffer is reused next step
        normed = self.model.final_hidden(self.model(batch.input_ids, self.context(batch)), batch.logits_rows)
        return self.model.lm_head(normed), (normed if self.medusa is not None else None)

    def run_scratch(self, tokens: int, seqs: int, decode: bool) -> torch.Tensor:
        """A forward of `tokens` tokens over `seqs` sequences whose K/V lands in
        the scratch block (slots overlap; the values are never read back
        except by themselves); returns the logits of each sequence's last token."""
        bs, scratch = self.block_size, self.cache.scratch_block
        lengths = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        fake = []
        for i, n in enumerate(lengths):
            # decode: n-1 cached tokens + 1 new one, all inside the scratch block
            computed = min(n, bs) - 1 if decode else 0
            scheduled = 1 if decode else n
            seq = ShardSequence(id=i, token_ids=[0] * (computed + scheduled), prompt_length=1,
                                num_computed=computed, block_table=[scratch] * math.ceil((computed + scheduled) / bs),
                                params=None, prefill_logprobs=False, scheduled=scheduled)
            fake.append(seq)
        batch = build_batch(fake, bs, self.device)
        if self.adapters is not None:
            self.adapters.set_segments([])
        with torch.inference_mode():
            hidden = self.model(batch.input_ids, self.context(batch))
            return self.model.logits(hidden, batch.logits_rows)

    def health(self) -> None:
        """Raises when the model cannot run a one-token step."""
        logits = self.run_scratch(1, 1, decode=False)
        if not bool(torch.isfinite(logits).all()):
            raise RuntimeError("the model produced non-finite logits")

    # -- steps -------------------------------------------------------------
    def step(self, request: pb.StepRequest) -> pb.StepResponse:
        t0 = time.perf_counter_ns()
        seqs = self.table.apply(request, self.tp.all_true,
                                self.tp.broadcast_from_first if self.tp.world_size > 1 else None)
        if not seqs:
            return pb.StepResponse(step_id=request.step_id, timings=pb.Timings(total_ns=time.perf_counter_ns() - t0))
        try:
            self._draft([s for s in seqs if s.draft_limit])
            batch = self._batch(seqs)
            t1 = time.perf_counter_ns()
            with torch.inference_mode():
                logits, normed = self.logits(batch)  # [S, vocab] float32, [S, hidden] or None
                t2 = time.perf_counter_ns()
                if normed is not None:
                    self._keep_medusa_rows(batch, normed)
                # Rank 0 samples; the others answer with computed-token counts only.
                sampler = self.sampler if self.is_sampling_rank else None
                generations = generations_of(batch, logits, sampler, self.grammars)
        except Exception:
            # The scheduled sequences' state is now unknown: drop them so the
            # router re-sends them in full (or releases them).
            self.table.release([s.id for s in seqs])
            raise
        self.table.advance(seqs)
        t3 = time.perf_counter_ns()
        return pb.StepResponse(
            step_id=request.step_id,
            generations=[generations[s.id] for s in seqs],
            timings=pb.Timings(prepare_ns=t1 - t0, forward_ns=t2 - t1, sample_ns=t3 - t2, total_ns=t3 - t0))

    def _draft(self, seqs: list[ShardSequence]) -> None:
        """Appends each sequence's drafts (up to its draft_limit): from the
        draft model or the Medusa heads when the shard has them, else by
        n-gram lookup."""
        if not seqs:
            return
        if self.draft is not None:
            with torch.inference_mode():
                self.draft.propose(seqs)
        elif self.medusa is not None:
            # The normed hidden state of the row that sampled each sequence's last token.
            seqs = [s for s in seqs if s.medusa_rows is not None]
            if seqs:
                with torch.inference_mode():
                    drafts = self.medusa(torch.stack([s.medusa_rows[s.last_kept - 1] for s in seqs])).tolist()
                for seq, row in zip(seqs, drafts):
                    seq.add_drafts(row[:seq.draft_limit])
        else:
            for seq in seqs:
                seq.add_drafts(seq.ngram_drafts())
        # A constrained sequence drafts only what its grammar allows: rank 0
        # (which alone holds grammars) says how many, and every rank cuts there.
        constrained = [s for s in seqs if s.constrained and s.drafted]
        if constrained:
            allowed = [self.grammars.allowed_prefix(s.grammar, s.drafts) if self.is_sampling_rank else 0
                       for s in constrained]
            for seq, n in zip(constrained, self.tp.broadcast_from_first(allowed)):
                seq.drop_drafts(seq.drafted - n)

    def _keep_medusa_rows(self, batch: StepBatch, normed: torch.Tensor) -> None:
        """Each sampling sequence keeps its rows' normed hidden states (every
        rank: the next step's drafts come from the row of the last token kept)."""
        for seq, first in zip(batch.sampling_seqs, batch.sample_rows):
            seq.medusa_rows = normed[first:first + 1 + seq.drafted]

    def context(self, batch: StepBatch) -> ForwardContext:
        """What the model's forward of `batch` runs under: the batch's attention
        metadata over this runner's KV cache and backend (the forward writes
        the batch's K/V into the cache)."""
        return batch.context(self.cache.layers, self.backend)
