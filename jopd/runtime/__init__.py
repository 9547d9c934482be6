"""Process-wide runtime defaults applied before JAX starts (XLA:CPU flags, host malloc)."""
