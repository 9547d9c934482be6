"""`jopd aot`'s compile pool: jobs start largest first, results and errors come back by key, and a report compiled
on two threads equals the one compiled on one."""

import threading

import pytest

from jopd.sizing import aot
from jopd.sizing.compile_pool import CompilePool
from tests.sizing.test_aot import tiny_cfg


def test_one_thread_runs_the_largest_first_and_raises_a_jobs_error_at_wait():
    order = []
    with CompilePool(1) as pool:
        for key, size in (("small", 1), ("large", 30), ("middle", 7)):
            pool.add(key, size, lambda key=key: order.append(key) or key.upper())
        pool.run()
        assert order == ["large", "middle", "small"]
        assert pool.wait(["small", "large"]) == {"small": "SMALL", "large": "LARGE"}

        def broken():
            raise RuntimeError("compiler said no")

        pool.add("broken", 5, broken)
        pool.run()
        with pytest.raises(RuntimeError, match="compiler said no"):
            pool.wait(["broken"])
        with pytest.raises(ValueError, match="added twice"):
            pool.add("small", 1, lambda: None)
    with pytest.raises(ValueError, match="--compile-threads"):
        CompilePool(0)


def test_two_threads_run_jobs_side_by_side():
    both = threading.Barrier(2, timeout=10)  # each job waits for the other: only passes if they run at once
    with CompilePool(2) as pool:
        for key in ("a", "b"):
            pool.add(key, 1, lambda key=key: both.wait() >= 0 and key)
        pool.run()
        assert pool.wait(["a", "b"]) == {"a": "a", "b": "b"}


def test_a_report_compiled_two_at_once_equals_one_compiled_alone():
    cfg = tiny_cfg("mesh.data=2", "mesh.fsdp=4")
    one, two = (aot.compile_opd_step(cfg, progress=False, compile_threads=n) for n in (1, 2))
    assert (one.compile_threads, two.compile_threads) == (1, 2)
    assert [s.name for s in two.stages] == list(aot.STAGES)  # the report's order, not the compiles'
    assert [s.memory for s in one.stages] == [s.memory for s in two.stages]
    assert [s.cost.flops for s in one.stages] == [s.cost.flops for s in two.stages]
    assert one.buffers == two.buffers
