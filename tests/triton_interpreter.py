"""Run the Triton kernels on a CPU: Triton's interpreter, made fast enough for CI.

`use_triton_interpreter()` must run before triton is first imported in the
process (tests/conftest.py calls it first thing): triton reads
TRITON_INTERPRET when it decorates a kernel, its own library functions
included, and torch._dynamo imports triton as soon as it is installed. Where
CUDA is available nothing changes, so the same tests run the compiled kernels
on a GPU.
"""

import functools
import importlib.util
import os
import sys

import numpy as np
import torch


def _fast_dot(self, a, b, d, input_precision, max_num_imprecise_acc, _slow=None):
    # The interpreter's tl.dot calls np.matmul with an explicit dtype, which skips
    # BLAS (~15 ms for a 64x128x64 tile); for the float32 tiles our kernels use,
    # contiguous operands through BLAS give the same product in ~25 us.
    if a.data.dtype == b.data.dtype == d.data.dtype == np.float32:
        product = np.matmul(np.ascontiguousarray(a.data), np.ascontiguousarray(b.data))
        return type(d)(product + d.data, d.dtype.scalar)
    return _slow(self, a, b, d, input_precision, max_num_imprecise_acc)


@functools.cache
def use_triton_interpreter() -> bool:
    """Without CUDA, switch Triton to its interpreter. Returns True when Triton
    kernels can run here: triton installed, and a GPU or the interpreter on
    (False too when triton was imported before the interpreter could be set)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if torch.cuda.is_available():
        return True
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        return False  # too late: its kernels are compiled-mode functions
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter

    slow = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return _fast_dot(self, a, b, d, input_precision, max_num_imprecise_acc, _slow=slow)

    interpreter.InterpreterBuilder.create_dot = create_dot
    return True
