"""Float64 numpy references for the exact-KL tests: log-softmax over the last axis and KL(a || b) per position."""

import numpy as np


def log_softmax64(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def kl64(log_a, log_b):
    """KL(a || b) over the last axis from two log-distributions."""
    return (np.exp(log_a) * (log_a - log_b)).sum(-1)
