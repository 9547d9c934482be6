"""`jopd aot` of `rollout.partial`: the sample stage is the partial program (the carried rows' re-prefill at the
largest width, N, then the slot engine) with the train state's carry as its argument, the update holds the carry
beside it, and the roofline adds the re-prefill as its own cost program."""

import math

import numpy as np
import pytest

from jopd.run.config import load_config
from jopd.sizing import aot, arch

# tiny testbed models, the sampler on one batch shard (the 8 devices over `tensor`, the tiny dims replicated)
TINY = ["data.batch_size=8", "data.max_prompt_len=16", "sampling.max_new_tokens=8", "loss.top_k=8",
        "student.arch.num_layers=1", "teacher.arch.num_layers=1", "mesh.data=1", "mesh.tensor=-1",
        "mesh.on_indivisible=replicate"]
PARTIAL = ["rollout.staleness=1", "rollout.partial=true", "sampling.slots=4", "train.mismatch=exact",
           "loss.support=union"]
B, P, N, S = 8, 16, 8, 4


def _carry_bytes(vocab: int, top_k: int) -> int:
    """The carry's bytes from its fields' shapes (`sampling.partial.Carry`), replicated: whole on each device; with
    train.mismatch=exact the sampler's full log-softmax, with loss.support=union its top-k ids."""
    i4, f4, b1 = np.dtype(np.int32).itemsize, np.dtype(np.float32).itemsize, np.dtype(np.bool_).itemsize
    shapes = [((S, P), i4), ((S, P), b1), ((S, N), i4), ((S, N), f4), ((S, N), f4), ((S,), i4), ((S,), b1),
              ((S,), b1), ((S, N), f4), ((S, 2), np.dtype(np.uint32).itemsize), ((S,), i4), ((S, N), i4)]
    shapes += [((S, N, vocab), f4), ((S, N, top_k), i4)]
    return sum(math.prod(shape) * size for shape, size in shapes)


@pytest.fixture(scope="module")
def partial():
    cfg = load_config(None, TINY + PARTIAL)
    return cfg, aot.compile_opd_step(cfg, stages=["sample", "train_step"], progress=False)


def test_the_sample_stage_is_the_partial_program_with_the_carry(partial):
    cfg, report = partial
    s_cfg = arch.model_config_of(cfg.student, "student")
    carry = _carry_bytes(s_cfg.vocab_size, cfg.loss.top_k)
    assert report.buffers["carry"] == carry and not report.failures()
    sample, train = report.stages
    plain = aot.compile_opd_step(load_config(None, TINY + [p for p in PARTIAL if p != "rollout.partial=true"]),
                                 stages=["sample"], progress=False)
    # the carry is the partial program's argument (not held beside it) and its new carry an output
    assert sample.memory.argument - plain.stages[0].memory.argument >= carry
    assert sample.memory.output - plain.stages[0].memory.output >= carry
    assert "carry" not in sample.resident
    assert sample.resident["train_state_but_carry"] == report.buffers["train_state"] - carry
    # the update takes the state without the carry: held beside it
    assert train.resident["carry"] == carry
    assert f"sample: the partial-rollouts program (rollout.partial) at re-prefill width {N}" in report.table()
    assert "partial-rollouts" not in plain.table() and "notes" not in plain.to_dict()
