"""The online-softmax step shared by the Triton attention kernels.

Imports triton at module level: load it through tgi_kernels.triton.
"""

import triton
import triton.language as tl


@triton.jit
def attend_tile(q, k, v, visible, m, row_sum, acc, PRECISION: tl.constexpr):
    """Fold one tile of keys into a running softmax (flash-attention style).

    q [BM, BD] float32, already multiplied by scale * log2(e) (scores are in
    base 2); k/v [BN, BD] float32; visible [BM, BN] bool; running row max
    m [BM] (base 2), row sum row_sum [BM] (the softmax denominator) and
    unnormalised output acc [BM, BD].
    Returns the updated (m, row_sum, acc).

    Values are loaded as float32 because the interpreter computes bf16 wrongly;
    fp16/bf16 values are exact in tf32, so on a GPU PRECISION="tf32" loses
    nothing on the inputs ("ieee" for float32 caches).
    """
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BM, BN]
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))  # [BM]
    # A row that has seen no visible key yet keeps m = -inf; exp2(-inf - -inf)
    # would be NaN, so such rows subtract 0 instead.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(scores - m_safe[:, None])  # [BM, BN]
    alpha = tl.math.exp2(m - m_safe)  # [BM] rescales what was accumulated so far
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)  # [BM, BD]
    return m_new, row_sum, acc
