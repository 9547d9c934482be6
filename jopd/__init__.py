"""jopd: on-policy distillation of language models in JAX."""

__version__ = "0.1.0"
