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
PLAIN = TINY + [p for p in PARTIAL if p != "rollout.partial=true"]
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
    plain = aot.compile_opd_step(load_config(None, PLAIN), stages=["sample"], progress=False)
    # the carry is the partial program's argument (not held beside it) and its new carry an output
    assert sample.memory.argument - plain.stages[0].memory.argument >= carry
    assert sample.memory.output - plain.stages[0].memory.output >= carry
    assert "carry" not in sample.resident
    assert sample.resident["train_state_but_carry"] == report.buffers["train_state"] - carry
    # the update takes the state without the carry: held beside it
    assert train.resident["carry"] == carry
    assert f"sample: the partial-rollouts program (rollout.partial) at re-prefill width {N}" in report.table()
    assert "partial-rollouts" not in plain.table() and "notes" not in plain.to_dict()


def test_the_re_prefill_is_its_own_cost_program_at_the_largest_width():
    """On one device (the sampler's work whole, not split): the sample stage's cost programs are the prefill, the
    partial program's decode passes and the re-prefill, whose FLOPs are at least a forward's matmuls over its
    S x (P + N) positions (2 x the layers' params per position)."""
    import jax

    from jopd.sampling.partial import partial_schedule

    cfg = load_config(None, TINY + PARTIAL)
    report = aot.compile_opd_step(cfg, [jax.devices()[0]], stages=["sample"], progress=False, cost=True,
                                  chip="v5e")
    (sample,) = report.roofline.stages
    parts = {p.name: p for p in sample.parts}
    assert [p.name for p in sample.parts] == ["prefill", "decode", "re-prefill"]
    m = arch.model_config_of(cfg.student, "student")
    head = m.hidden_size * m.vocab_size
    layers = arch.param_count(m) - head * (1 if m.tie_word_embeddings else 2) - m.hidden_size
    again = parts["re-prefill"]
    assert again.count == 1 and again.cost.flops >= 2 * layers * S * (P + N)
    assert again.cost.flops < 3 * 2 * layers * S * (P + N)  # a forward, not the whole stage
    # every row to N tokens, the carried rows from their start: the schedule's passes (the slot engine's here)
    assert parts["decode"].count == partial_schedule([0] * S, [False] * S, [N] * (S + B), S, B).passes == 14
    assert any("worst case: every one of the 4 carried rows re-prefilled over P + N = 24" in n
               for n in report.roofline.notes)
    assert "at re-prefill width 8" in report.table()


def test_without_partial_the_sample_stage_is_the_engines_program():
    """rollout.partial off: the sample stage's memory is the slot engine's program compiled on its own, the state
    held whole beside it, no carry and no note (the report as before)."""
    import jax

    from jopd.opd.step import build_step
    from jopd.parallel import mesh as meshlib
    from jopd.sizing import stages
    from jopd.sizing.report import StageMemory

    cfg = load_config(None, PLAIN)
    report = aot.compile_opd_step(cfg, stages=["sample"], progress=False)
    s_cfg, t_cfg = (arch.model_config_of(src, role) for src, role in ((cfg.student, "student"),
                                                                      (cfg.teacher, "teacher")))
    step = build_step(cfg, s_cfg, (t_cfg,), meshlib.make_mesh(cfg.mesh))
    ins = stages.step_inputs(step)
    assert ins.carry is None and ins.engine > 0  # the slot engine
    with jax.set_mesh(step.sampler_mesh):
        own = step.sampler.program_for(ins.engine).lower(ins.sampler_params, *ins.unique, ins.rand, ins.cache).compile()
    (sample,) = report.stages
    assert sample.memory == StageMemory.of(own)
    assert sample.resident == {k: report.buffers[k] for k in ("train_state", "teacher_params")}
    assert "carry" not in report.buffers and "notes" not in report.to_dict() and "note:" not in report.table()
