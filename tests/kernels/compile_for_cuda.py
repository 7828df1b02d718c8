"""Compiles every Triton kernel to PTX for an sm_90 GPU, without a GPU.

The interpreter accepts programs the compiler refuses (a variable whose type
differs between the two sides of an if, dot shapes under 16), so the kernels
are also compiled here. Run in a process without TRITON_INTERPRET:
`python -m tests.kernels.compile_for_cuda`; prints one line per kernel.
"""

from concurrent.futures import ThreadPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tgi_kernels.triton import norm_act_kernel, paged_decode_kernel, store_kv_kernel, varlen_prefill_kernel

TARGET = GPUTarget("cuda", 90, 32)


def compile_sources(jobs: list[tuple[str, ASTSource, dict]]) -> list[str]:
    """(label, source, compile options) -> "compiled LABEL: N bytes of PTX" per
    job, in order. On two threads: triton's MLIR and LLVM passes run outside
    the GIL, so two cores compile twice as many kernels."""
    def one(job: tuple[str, ASTSource, dict]) -> str:
        label, source, options = job
        compiled = triton.compile(source, target=TARGET, options=options)
        return f"compiled {label}: {len(compiled.asm['ptx'])} bytes of PTX"
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, jobs))


def source(fn, pointers: dict, scalars: dict, constexprs: dict) -> ASTSource:
    signature = {**pointers, **scalars, **{name: "constexpr" for name in constexprs}}
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs)


def cases():
    i32 = "i32"
    # bf16 with GQA 8 / head 128 (what serves), float32 (the "ieee" dot path) at GQA 1 / head 64,
    # and bf16 over float8 caches (--kv-cache-dtype: e4m3fn is fp8e4nv, e5m2 fp8e5).
    for dtype, cache, (group, head_dim) in (("bf16", "bf16", (8, 128)), ("fp32", "fp32", (1, 64)),
                                            ("bf16", "fp8e4nv", (8, 128)), ("bf16", "fp8e5", (8, 128))):
        p, c = f"*{dtype}", f"*{cache}"
        precision = "ieee" if dtype == "fp32" else "tf32"
        fp8_max = {"fp8e4nv": 448.0, "fp8e5": 57344.0}.get(cache, 0.0)
        yield f"store_kv into {cache}", store_kv_kernel._store_kv_kernel, (
            dict(key=p, value=p, k_cache=c, v_cache=c, slot_mapping="*i64"),
            dict(stride_kt=i32, stride_kh=i32, stride_vt=i32, stride_vh=i32, k_inv_scale="fp32", v_inv_scale="fp32"),
            dict(KV_HEADS=4, HEAD_DIM=head_dim, BLOCK_H=4, BLOCK_D=head_dim, FP8_MAX=fp8_max))
        yield f"rotary_store_kv into {cache}", store_kv_kernel._rotary_store_kv_kernel, (
            dict(qkv=p, cos=p, sin=p, k_cache=c, v_cache=c, slot_mapping="*i64"),
            dict(stride_t=i32, stride_ct=i32, stride_st=i32, k_inv_scale="fp32", v_inv_scale="fp32"),
            dict(HEADS=4 * group, KV_HEADS=4, HEAD_DIM=head_dim, BLOCK_Q=4 * group, BLOCK_KV=4,
                 BLOCK_D=head_dim, FP8_MAX=fp8_max))
        if cache == "fp8e5":
            continue  # reads widen either float8 alike: e4m3fn's cases cover them
        for splits in (1, 4):
            yield f"paged_decode(splits={splits}) over {cache}", paged_decode_kernel._decode_kernel, (
                dict(query=p, k_cache=c, v_cache=c, block_tables="*i32", seq_lens="*i32", out=p,
                     part_out="*fp32", part_ml="*fp32"),
                dict(qk_scale="fp32", window=i32, num_splits=i32, stride_qb=i32, stride_qh=i32, stride_bt=i32,
                     stride_ob=i32, stride_oh=i32),
                dict(GROUP=group, KV_HEADS=4, HEAD_DIM=head_dim, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_D=head_dim,
                     BLOCK_N=64, PARTITION=512, SPLIT=splits > 1, PRECISION=precision))
        if cache == dtype:  # the per-token kernels and merge_splits read no cache
            for add in (False, True):
                yield f"rms_norm(add={add})", norm_act_kernel._rms_norm_kernel, (
                    dict(x=p, residual=p, weight=p, out=p), dict(stride_x=i32, stride_r=i32, stride_o=i32, eps="fp32"),
                    dict(N=2048, BLOCK_N=2048, ADD=add))
            for gelu in (False, True):
                yield f"gated_act(gelu={gelu})", norm_act_kernel._gated_act_kernel, (
                    dict(gate_up=p, out=p), dict(stride_g=i32, stride_o=i32), dict(INTER=5632, BLOCK=1024, GELU=gelu))
            yield "merge_splits", paged_decode_kernel._merge_splits_kernel, (
                dict(part_out="*fp32", part_ml="*fp32", out=p), dict(stride_ob=i32, stride_oh=i32, num_splits=i32),
                dict(HEADS=4 * group, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_S=8))
        yield f"varlen_prefill over {cache}", varlen_prefill_kernel._prefill_kernel, (
            dict(query=p, key=p, value=p, k_cache=c, v_cache=c, cu_seqlens_q="*i32", prefix_lens="*i32",
                 block_tables="*i32", out=p),
            dict(qk_scale="fp32", window=i32, **{f"stride_{s}": i32 for s in
                                                  ("qt", "qh", "kt", "kh", "vt", "vh", "bt", "ot", "oh")}),
            dict(GROUP=group, KV_HEADS=4, HEAD_DIM=head_dim, BLOCK_SIZE=16, TILE_TOKENS=64 // group,
                 BLOCK_M=64, BLOCK_N=64, BLOCK_D=head_dim, PRECISION=precision))


def main() -> None:
    jobs = [(f"{name} head_dim={constexprs.get('HEAD_DIM', '-')} "
             f"{pointers.get('out', pointers.get('key', pointers.get('qkv')))}",
             source(fn, pointers, scalars, constexprs), {})
            for name, fn, (pointers, scalars, constexprs) in cases()]
    for line in compile_sources(jobs):
        print(line)


if __name__ == "__main__":
    main()
