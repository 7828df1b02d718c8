"""Decode steps by batch-size bucket (TGI's --cuda-graphs): a pure-decode step
of n sequences runs what was prepared at Warmup for the smallest size >= n.
On CUDA that is a captured CUDA graph, replayed instead of launching every
kernel of the forward one by one; on the CPU a forward compiled by
torch.compile for that size (`mode="compile"`, see `compile_available`).

All graphs share one set of static input tensors sized for the largest batch
and the widest block table a sequence can have; a step copies its inputs into
their first n rows and pads the rest with harmless rows: one token of context
in the scratch block, written to the scratch block's first slot. The KV cache
tensors must stay the ones captured: build DecodeGraphs after Warmup sizes the
cache, and again whenever it is reallocated.

Only backends whose decode reads the block table inside the kernel are
captured (triton; flash_attn with paged blocks): the others gather the whole
table width every step, which a graph would make slower, not faster.

On the CPU every heavy op of a step is already one of our C++ kernels
(tgi_kernels.native, registered with shape functions), so inductor fuses
little: what compiling takes away is Python's cost around ~15 ops a layer
(module calls, attribute lookups, the context's dataclasses). Logits come out
bit for bit the same at the same row count. Decode throughput gains most at
small batches, where that cost is the larger share of a step (figures:
docs/tuning.md#cpu-compiled-decode-steps, where a dynamic-shape graph for
every size, which gains less, is recorded too). Compiling takes seconds a
size, once: inductor's caches live under the kernels' cache
(`TORCHINDUCTOR_CACHE_DIR`, default ~/.cache/tgi_kernels/inductor/<machine>),
and a restart takes less.

Padded rows cost the CPU their arithmetic, where a GPU's decode step is
bound by reading the weights and pads nearly for free: a dense model's CPU
GEMMs are bound by arithmetic from ~8 rows, so a step padded up to the next
size can take longer than the eager step (figures:
docs/tuning.md#padding-floors). So Warmup times each compiled size against
eager steps (`_calibrate`) and a step runs compiled only from the row count
where padding costs less than compiling saves (`padding_floors`); fewer
rows run eagerly.
"""

import logging
import math
import os
import time
from collections.abc import Callable

import torch

from tgi_kernels import DecodeMeta
from tgi_kernels.native import cache_root, find_compiler, machine_tag

from .batch import StepBatch
from .layers.attention import ForwardContext

log = logging.getLogger("tgi_server")

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)  # TGI's default for --cuda-graphs
# On CPUs also 64: compiled, a full step of 64 rows still beats the eager one, for one
# more size to compile at each start (figures: docs/tuning.md#cpu-default-batch-sizes);
# padding_floors keeps the rows between 33 and ~60 eager.
CPU_DEFAULT_BATCH_SIZES = DEFAULT_BATCH_SIZES + (64,)
COMPILE_ENV = "TGI_CPU_COMPILE"  # "0": CPU shards run decode steps eagerly
FLASH_PAGED_BLOCK = 256  # flash-attn reads a paged cache only for block sizes divisible by this


def graph_batch_sizes(requested: tuple[int, ...] | None, max_batch_size: int,
                      device: torch.device) -> tuple[int, ...]:
    """The requested sizes (None: the device's default) that a step can reach
    (<= max_batch_size), sorted."""
    if requested is None:
        requested = CPU_DEFAULT_BATCH_SIZES if device.type == "cpu" else DEFAULT_BATCH_SIZES
    return tuple(sorted({n for n in requested if 0 < n <= max_batch_size}))


def padded_batch_size(sizes: tuple[int, ...], n: int) -> int | None:
    """The smallest captured size that holds n sequences; None if none does."""
    return next((size for size in sizes if size >= n), None)


def padding_floors(sizes: tuple[int, ...], eager_ms: dict[int, float],
                   compiled_ms: dict[int, float]) -> dict[int, int]:
    """For each compiled size s: the fewest rows n (s + 1: none) whose step
    runs compiled, padded to s rows, because that is expected to beat the
    eager step of n rows; fewer rows run eagerly. eager_ms holds eager step
    times at 1 row and at every size, compiled_ms compiled ones at every size.

    What compiling saves is taken as one amount for every size (the median
    of eager - compiled over the sizes: Python's cost around the ops, which
    the row count hardly changes), what a padded row costs as the slope of
    the eager times between s and the size below it. One median and one
    slope over many rows resist the host's noise better than comparing each
    size's two times, which differ by a few percent. (Why padding costs on
    the CPU: the module's docstring.)"""
    ordered = sorted(sizes)
    savings = sorted(eager_ms[size] - compiled_ms[size] for size in ordered)
    saving = savings[len(savings) // 2]  # the upper median
    floors, below = {}, 0  # below: the size before (0: none)
    for size in ordered:
        lo = max(below, 1)  # the measured row count below this size
        slope = (eager_ms[size] - eager_ms[lo]) / (size - lo) if size > lo else 0.0  # ms a row
        if saving <= 0:
            floors[size] = size + 1
        elif slope <= 0:
            floors[size] = below + 1
        else:
            floors[size] = max(below + 1, math.ceil(size - saving / slope))
        below = size
    return floors


def backend_supports_graphs(backend: str, block_size: int) -> bool:
    return backend == "triton" or (backend == "flash_attn" and block_size % FLASH_PAGED_BLOCK == 0)


def compile_available() -> str | None:
    """None where CPU decode steps may be compiled, else why not: TGI_CPU_COMPILE=0,
    or no C++ compiler for inductor's generated code."""
    if os.environ.get(COMPILE_ENV, "1") == "0":
        return f"{COMPILE_ENV}=0"
    if find_compiler() is None:
        return "no C++ compiler (g++, c++ or clang++) on PATH"
    return None


def _inductor_cache() -> None:
    """Inductor's on-disk caches beside our kernels' (or under the place the
    caller, or inductor itself once it ran, chose), one folder per
    machine_tag: inductor reused code it had generated for AVX-512 when the
    same machine ran with ATEN_CPU_CAPABILITY=avx2, and the logits were wrong
    (right from a fresh cache; docs/tuning.md#cpu-compiled-decode-steps)."""
    tag = machine_tag()
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(cache_root() / "inductor")
    if os.path.basename(base) != tag:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, tag)


class DecodeGraphs:
    """Decode forwards captured per batch size; `run` replays one.

    forward(input_ids [B], ctx) -> [B, ...] is what each graph computes (the
    runner captures the logits [B, vocab], the final norm and LM head
    included). mode: "capture" (CUDA graphs), "compile" (CPU: torch.compile
    per size, compiled here, at Warmup; raises where inductor cannot), or
    "eager" (tests: the forward on the static tensors, so padding and
    selection are tested without a GPU or a compiler). threads: the torch
    thread count to compile for (the most the shard runs; default: the
    current count); steps run compiled only under that count.

    The static inputs are views of two device buffers, one int64 (token ids,
    positions, slots) and one int32 (context lengths, block tables), each
    mirrored in pinned host memory: a step writes its inputs and padding on
    the host and sends each buffer in one asynchronous copy, where copying
    field by field took a dozen launches and blocking copies while the GPU
    idled (figures: docs/tuning.md#cuda-graph-inputs)."""

    def __init__(self, forward: Callable[[torch.Tensor, ForwardContext], torch.Tensor],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: str, block_size: int,
                 max_blocks: int, scratch_block: int, sizes: tuple[int, ...], device: torch.device,
                 mode: str = "capture", threads: int | None = None):
        self.forward, self.kv_caches, self.backend = forward, kv_caches, backend
        self.block_size, self.max_blocks, self.scratch_block = block_size, max_blocks, scratch_block
        self.sizes = tuple(sorted(sizes))
        largest = self.sizes[-1]
        pinned = device.type == "cuda"
        self._i64 = torch.zeros(3, largest, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(largest * (1 + max_blocks), dtype=torch.int32, device=device)
        self._host_i64 = torch.zeros(self._i64.shape, dtype=torch.int64, pin_memory=pinned)
        self._host_i32 = torch.zeros(self._i32.shape, dtype=torch.int32, pin_memory=pinned)
        self._sent: torch.cuda.Event | None = None  # the last host-to-device copy, on CUDA
        self.input_ids, self.positions, self.slot_mapping = self._i64  # [S] int64 each
        self.seq_lens = self._i32[:largest]  # [S] int32
        self.block_tables = self._i32[largest:].view(largest, max_blocks)  # [S, W] int32
        self._pad_host(0, largest)
        self._send(largest)
        self.graphs: dict[int, Callable[[], None]] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> static output [size, ...]
        pool = torch.cuda.graph_pool_handle() if mode == "capture" else None
        # The torch thread count every compiled size is compiled for (None: not
        # compiled): dynamo guards on it, so a step under another count (the
        # thread governor's doing) runs eagerly rather than recompiling (~10 s)
        # in the middle of serving.
        self.threads = (threads or torch.get_num_threads()) if mode == "compile" else None
        if mode == "compile":
            _inductor_cache()
            # One code object, one graph per size: what an earlier Warmup
            # compiled can never match again (other static tensors), so it goes.
            torch._dynamo.reset()
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(self.sizes))
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory pool
            self.graphs[size] = (self._capture(size, pool) if mode == "capture" else
                                 self._compile(size) if mode == "compile" else self._eager(size))
        # The fewest rows each size runs (padding_floors): measured where compiled.
        self.floors = self._calibrate() if mode == "compile" else dict.fromkeys(self.sizes, 1)

    def _context(self, size: int) -> ForwardContext:
        # max_seq_len is the widest table: it only bounds the kernel's splits.
        meta = DecodeMeta(block_tables=self.block_tables[:size], seq_lens=self.seq_lens[:size],
                          max_seq_len=self.max_blocks * self.block_size)
        return ForwardContext(positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
                              num_decode_tokens=size, decode=meta, prefill=None,
                              kv_caches=self.kv_caches, backend=self.backend)

    def _eager(self, size: int) -> Callable[[], None]:
        ctx = self._context(size)

        def run():
            ctx.decode.derived.clear()  # what a gathering backend derived from the last run's tables
            self.outputs[size] = self.forward(self.input_ids[:size], ctx)
        return run

    def _compile(self, size: int) -> Callable[[], None]:
        ctx = self._context(size)
        ids = self.input_ids[:size]
        # One graph, no breaks (fullgraph), specialized to this size; no size
        # asserts: inductor would check every op's output strides each step.
        # No guards on the model's modules: dynamo would check the attributes
        # of its ~400 modules at every step (figures:
        # docs/tuning.md#cpu-compiled-decode-steps). They never change once loaded:
        # every attribute is set at load, and a new model or cache is a new
        # DecodeGraphs after torch._dynamo.reset(). Guards on the inputs and
        # on globals (the thread count) stay.
        forward = torch.compile(self.forward, dynamic=False, fullgraph=True, options={
            "size_asserts": False, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

        def run():
            self.outputs[size] = forward(ids, ctx)
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)  # whatever the governor last chose
        try:
            run()  # compiles now, at Warmup, not at the first step of this size
        finally:
            torch.set_num_threads(previous)
        return run

    def _calibrate(self, reps: int = 5) -> dict[int, int]:
        """padding_floors from each size's step timed compiled and eagerly (and
        one row eagerly), the fastest of `reps` runs each, taking turns, on the
        padding rows (contexts of one token: attention costs a row the same
        either way) under the thread count the sizes were compiled for."""
        eager_ms, compiled_ms = {}, {}
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            for n in sorted({1, *self.sizes}):
                def eager(n: int = n) -> None:
                    self.forward(self.input_ids[:n], self._context(n))
                runs = [(eager, eager_ms)] + ([(self.graphs[n], compiled_ms)] if n in self.graphs else [])
                for fn, times in runs * reps:
                    start = time.perf_counter()
                    fn()
                    times[n] = min(times.get(n, math.inf), 1000 * (time.perf_counter() - start))
        finally:
            torch.set_num_threads(previous)
        floors = padding_floors(self.sizes, eager_ms, compiled_ms)
        log.info("compiled decode steps against eager, ms: %s; a step runs compiled from %s rows up to each size "
                 "(fewer: eagerly, padding would cost more than compiling saves)",
                 ", ".join(f"{size}: {compiled_ms[size]:.2f} / {eager_ms[size]:.2f}" for size in self.sizes),
                 ", ".join(f"{floors[size]} to {size}" if floors[size] <= size else f"none to {size}"
                           for size in self.sizes))
        return floors

    def _capture(self, size: int, pool) -> Callable[[], None]:
        ctx = self._context(size)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile kernels and settle allocations before capture
            for _ in range(2):
                self.forward(self.input_ids[:size], ctx)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[size] = self.forward(self.input_ids[:size], ctx)
        return graph.replay

    def _pad_host(self, start: int, end: int) -> None:
        """On the host: rows start..end-1 become padding, one token in the scratch block.

        Columns past a row's own blocks are never read (seq_lens bound the reads)
        but must hold valid block ids for backends that gather them: whatever
        an earlier step left there is one, so they are not rewritten."""
        ids, positions, slots = self._host_i64
        ids[start:end] = 0
        positions[start:end] = 0
        slots[start:end] = self.scratch_block * self.block_size
        self._host_i32[start:end] = 1  # seq_lens
        self._host_tables()[start:end, 0] = self.scratch_block

    def _host_tables(self) -> torch.Tensor:
        largest = self._host_i64.shape[1]
        return self._host_i32[largest:].view(largest, self.max_blocks)

    def _send(self, size: int) -> None:
        """Copies the inputs of the first `size` rows (all of seq_lens, the block
        tables' first `size` rows: a contiguous prefix of the int32 buffer)."""
        self._i64.copy_(self._host_i64, non_blocking=True)
        used = self._host_i64.shape[1] + size * self.max_blocks
        self._i32[:used].copy_(self._host_i32[:used], non_blocking=True)
        if self._i64.device.type == "cuda":
            self._sent = torch.cuda.Event()
            self._sent.record()

    def can_run(self, batch: StepBatch) -> bool:
        """True for a pure-decode step that fits a captured size and table width
        (and, compiled, has at least its size's floor of rows and runs under
        the thread count its size was compiled for)."""
        n = batch.num_decode_tokens
        return (batch.prefill is None and batch.decode is not None and n <= self.sizes[-1]
                and n >= self.floors[padded_batch_size(self.sizes, n)]
                and batch.decode.block_tables.shape[1] <= self.max_blocks
                and self.threads in (None, torch.get_num_threads()))

    def run(self, batch: StepBatch) -> torch.Tensor:
        """The output rows [n, ...] of the step's n decode tokens (see can_run);
        the batch's tensors are best on the CPU (build_batch on the host)."""
        n = batch.num_decode_tokens
        size = padded_batch_size(self.sizes, n)
        width = batch.decode.block_tables.shape[1]
        if self._sent is not None:
            self._sent.synchronize()  # the pinned buffers are free again (usually long since)
        self._host_i64[0, :n] = batch.input_ids
        self._host_i64[1, :n] = batch.positions
        self._host_i64[2, :n] = batch.slot_mapping
        self._host_i32[:n] = batch.decode.seq_lens
        self._host_tables()[:n, :width] = batch.decode.block_tables
        self._pad_host(n, size)
        self._send(size)
        self.graphs[size]()
        return self.outputs[size][:n]
