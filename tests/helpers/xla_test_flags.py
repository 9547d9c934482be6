"""XLA:CPU flags the test suite compiles with (set by tests/conftest.py; the suite's subprocesses that set their own
XLA_FLAGS add them too, so a subprocess and its parent test compute with the same code).

The suite compiles many small programs once each, and on 2 cores compiling costs more than running them: most
of a typical test's time is XLA's backend compile. LLVM's optimization passes are off, and fusions are emitted
by XLA:CPU's older loop emitters instead of its MLIR fusion emitters (jaxlib 0.10: about half the compile time
of the packing tests). Tests check what XLA computes (its HLO, fusions and float semantics: LLVM without fast-math
does not reorder float arithmetic, and either emitter computes the same fused HLO), so the checks hold under
either setting; runs outside the tests keep XLA's defaults."""

import contextlib

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")


def with_fast_compile(xla_flags: str) -> str:
    """`xla_flags` plus the fast-compile flags it does not set itself."""
    extra = [f for f in FAST_COMPILE.split() if f.split("=")[0] + "=" not in xla_flags]
    return " ".join([xla_flags.strip(), *extra]).strip()


# XLA's own defaults for the three flags above (jaxlib 0.10), as per-compile option overrides.
XLA_DEFAULTS = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False,
                "xla_cpu_use_fusion_emitters": True}


@contextlib.contextmanager
def compiled_for_speed():
    """Programs compiled inside this block get XLA's default optimizations back, for the few tests whose time goes
    to running one program many times rather than to compiling many (the GRPO-learns run: 100 steps, ~40 s with
    the fast-compile flags on this VM, ~30 s without). Only for tests that compare nothing bit for bit against a
    program compiled outside the block. jax has no public per-scope compile option; jit's `compiler_options` is
    per function, so this wraps the one place every compile's options are made."""
    from jax._src import compiler

    make = compiler.get_compile_options

    def with_defaults(*args, env_options_overrides=None, **kwargs):
        return make(*args, env_options_overrides={**XLA_DEFAULTS, **(env_options_overrides or {})}, **kwargs)

    compiler.get_compile_options = with_defaults
    try:
        yield
    finally:
        compiler.get_compile_options = make
