"""Test setup: 8 simulated CPU devices and fast-compile XLA flags (tests/helpers/xla_test_flags.py), set before jax
is imported anywhere; one persistent XLA compilation cache and one jopd cache ($JOPD_CACHE) per test session, shared by the
xdist workers and the subprocesses tests start (a program compiled once — the tiny testbed's stages, the CLI's runs — is not compiled
again by the next test or process)."""

import atexit
import os
import shutil
import tempfile

from tests.helpers.xla_test_flags import with_fast_compile  # imports nothing else

os.environ["XLA_FLAGS"] = with_fast_compile(
    (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())

from jopd.runtime.xla_flags import apply_cpu_defaults  # noqa: E402  (imports jaxlib only, not jax)

apply_cpu_defaults()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download weights
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the session's first process (xdist's controller): make it
    _cache = tempfile.mkdtemp(prefix="jopd-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache  # workers and subprocesses inherit it
    if "JOPD_CACHE" not in os.environ:  # jopd's own cache (converted GGUF tokenizers, models a test trains
        _jopd = tempfile.mkdtemp(prefix="jopd-tests-cache-")  # without its own cache_dir): one per session, not ~
        atexit.register(shutil.rmtree, _jopd, ignore_errors=True)
        os.environ["JOPD_CACHE"] = _jopd
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.05")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    """The longest modules first, each module's tests kept together (README's command adds `--dist loadfile`: a
    module's tests all run on one worker, so its module fixtures are built, and the programs its tests share are
    traced and compiled, once instead of once per worker: 20:15 vs 24:10 of CPU time on the whole suite). Longest
    first, by the seconds of a past run (tests/module_seconds.json; a module not in it counts as 60 s if it holds
    a `slow` test, else 0): the suite then ends on short modules instead of one worker finishing a long one alone."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    past = json.loads((root / "tests" / "module_seconds.json").read_text())
    slow = {item.path for item in items if item.get_closest_marker("slow")}

    def seconds(item) -> float:
        known = past.get(item.path.relative_to(root).as_posix())
        return known if known is not None else 60.0 if item.path in slow else 0.0

    items[:] = sorted(items, key=lambda item: -seconds(item))  # stable: a module's tests stay in their order


@pytest.fixture(autouse=True, scope="session")
def _warm_starts_compiled_for_speed():
    """A warm start (SFT) runs one program for tens to hundreds of steps: it compiles with XLA's default
    optimizations (tests/helpers/xla_test_flags.compiled_for_speed), as it does outside the tests, instead of the
    suite's fast-compile flags, which cost more in running so many steps than they save in compiling (measured:
    docs/performance.md, "The test suite's time").
    Every SFT in the session runs so, in each xdist worker alike; the models it caches are loaded by the tests'
    subprocesses, which never train one that an in-process run also trains."""
    from jopd.run import warm_start
    from tests.helpers.xla_test_flags import compiled_for_speed

    run_sft = warm_start.run_sft

    def run_sft_compiled_for_speed(*args, **kwargs):
        with compiled_for_speed():
            return run_sft(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(warm_start, "run_sft", run_sft_compiled_for_speed)
        yield
