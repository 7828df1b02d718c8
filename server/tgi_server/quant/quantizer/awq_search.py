"""AWQ (Lin et al., 2023): before rounding, scale up the input channels that
carry large activations (and scale the op feeding them down by the same
factors), so their weights lose less to rounding. The factors are
s = mean|x|^alpha, with alpha picked on a grid to minimise the error of the
layers' outputs on calibration inputs. Each alpha is judged, as in the
paper, by plain min-max rounding to nearest; the final rounding, with its
grids searched for output error, is GPTQ's (quantize_model.py)."""

import torch

from ..quantized_matrix import quantize_rtn

# alpha in 0, 0.1, ..., 0.9: a finer grid overfits the calibration data, on which the best
# alpha is noisy, and takes longer (figures: docs/tuning.md#awq-grid).
GRID = 10


def fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """weight [N, K] rounded as AWQ stores it (4 bits, asymmetric min-max groups) and back."""
    return quantize_rtn(weight, 4, group_size, symmetric=False).dequantize()


def search_scales(inputs: torch.Tensor, weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """inputs [T, K]: calibration inputs shared by `weights` (each [N_i, K]).
    -> per-input-channel factors s [K]: quantize W * s, feed the inputs / s.
    alpha = 0 (s = 1, plain rounding) is on the grid, so the result is never
    worse than rounding on these inputs."""
    x = inputs.float()
    w = torch.cat([t.float() for t in weights])  # [sum N_i, K]
    # The outputs' mean squared error, mean over [T, N] of (x_t . e_n)^2 for the
    # weight error E [N, K], is sum_n e_n^T H e_n / N with H = X^T X / T: one
    # [K, K] matrix instead of two [T, N] products per alpha (T = 32k tokens).
    hessian = x.T @ x / x.shape[0]                # [K, K]
    activation = x.abs().mean(0)                  # [K]
    best, best_loss = torch.ones_like(activation), float("inf")
    for step in range(GRID):
        alpha = step / GRID
        s = activation.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        error = fake_quantize(w * s, group_size) / s - w  # [N, K]: W * s sees inputs x / s
        loss = float(((error @ hessian) * error).sum() / error.shape[0])
        if loss < best_loss:
            best, best_loss = s, loss
    return best
