"""The bf16-vs-fp32 logit tolerance shared by the bf16 tests, and why.

bf16 keeps 8 significant bits, so every rounding (weights cast to bf16, each matmul input/output, the residual
stream after each of the 2L residual additions, softmax probabilities, the SwiGLU product) has relative error
<= u = 2^-8. These errors are independent and add in quadrature along the residual stream, so the logits'
relative RMS error grows like u * sqrt(2L) times a constant c of order one (a few roundings per sublayer, damped by
the RMSNorms). Measured c (rel. RMS / (u sqrt(2L))): 1.2-2.0 on the random tiny models of tests/helpers/hf_models.py
(L=2, rel. RMS 0.90%-1.53%), 0.86 on SmolLM2-135M (L=30, rel. RMS 2.6%, max |Δlogit| 1.36 on max |logit| 38).
The tolerance takes c = 3: 1.5x above the worst measured constant, far below an O(1) error.
"""

import math

import numpy as np

BF16_UNIT_ROUNDOFF = 2.0 ** -8
C = 3.0


def bf16_rel_rms_tolerance(num_layers: int) -> float:
    return C * BF16_UNIT_ROUNDOFF * math.sqrt(2 * num_layers)


def rel_rms(approx: np.ndarray, exact: np.ndarray) -> float:
    approx, exact = np.asarray(approx, np.float64), np.asarray(exact, np.float64)
    return float(np.sqrt(np.mean((approx - exact) ** 2) / np.mean(exact ** 2)))
