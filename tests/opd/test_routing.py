"""One teacher is a routing of one (`opd.routing`): the step, the scoring and the held-out eval take the same path
for one teacher and for several; `Routing.sole_scorer` is where a routing whose rows all go to one teacher runs
that teacher alone."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from jopd.data.mixture import task_sources
from jopd.run.evaluate import heldout_divergence_B, mixture_divergence_BxN, teacher_divergence_BxN
from jopd.opd.routing import Routing, resolve_routing, row_teachers
from jopd.opd.step import build_step
from jopd.parallel import mesh as M
from tests.helpers.tiny_params import numpy_params
from tests.opd.test_teachers import MIX, STUDENT, T_A, T_B, TEACHERS, TWO, _cfg


def test_one_teacher_is_a_routing_of_one():
    cfg = _cfg()
    step = build_step(cfg, STUDENT, (T_A,), M.make_mesh(cfg.mesh, jax.devices()[:1]))
    tasks = tuple(s.name for s in task_sources(cfg.data))
    assert step.routing == Routing.one("teacher", tasks) == resolve_routing(cfg, 1, 1)
    assert step.routing.sole_scorer == 0 and step.routing.eval_teacher(0) == 0
    assert step.cross == (None,) and step.crosses == () and len(step.shardings.teacher) == 1
    assert len(step.abstract_teacher()) == 1
    with pytest.raises(ValueError, match=r"build_step: one RunConfig.teacher, but t_cfg is one ModelConfig"):
        build_step(cfg, STUDENT, T_A, M.make_mesh(cfg.mesh, jax.devices()[:1]))


def test_sole_scorer_and_row_teachers():
    cfg = _cfg(*MIX, *TWO)
    task = resolve_routing(cfg, 1, 1)
    assert task.mode == "task" and task.sole_scorer is None
    np.testing.assert_array_equal(row_teachers(np.asarray([1, 0, 1]), task), [1, 0, 1])
    to_count = resolve_routing(_cfg(*MIX, *TWO, "routing=count"), 1, 1)
    assert to_count.mode == "one" and to_count.sole_scorer == 1
    np.testing.assert_array_equal(row_teachers(np.asarray([1, 0, 1]), to_count), [1, 1, 1])
    assert resolve_routing(_cfg(*MIX, *TWO, "routing=mixture"), 1, 1).sole_scorer is None
    # a mixture of one teacher: that teacher scores (and aligns) every row
    alone = resolve_routing(_cfg(*MIX, "teachers=[{name: only, weight: 0.3}]", "routing=mixture"), 1, 1)
    assert alone.sole_scorer == 0
    np.testing.assert_array_equal(row_teachers(np.asarray([1, 0, 1]), alone), [0, 0, 0])


def test_the_eval_divergence_follows_the_routing():
    """Each row's held-out divergence is the response mean of its eval teacher's KL, bit for bit: the one teacher's
    for every row, each task's own teacher's, the mixture's."""
    rng = np.random.RandomState(0)
    B, P, N = 6, 4, 5
    tokens = rng.randint(3, STUDENT.vocab_size, (B, P + N)).astype(np.int32)
    attn = np.ones((B, P + N), bool)
    attn[:, P:] = np.arange(N)[None] < rng.randint(1, N + 1, (B, 1))
    task = np.asarray([0, 1, 1, 0, 1, 0])
    out = types.SimpleNamespace(tokens_BxN=tokens[:, P:])
    student = numpy_params(STUDENT, seed=4)
    mask = attn[:, P:]

    def mean(kl):
        kl = np.asarray(kl)
        return (kl * mask).sum(1) / np.maximum(mask.sum(1), 1)

    def divergence(routing, t_cfgs, params):
        return heldout_divergence_B(student, params, task, s_cfg=STUDENT, t_cfgs=t_cfgs, routing=routing,
                                    crosses=(None,) * len(t_cfgs), per_character=False, tokenizer=None, batch=None,
                                    out=out, tokens=tokens, attn=attn, temperature=1.0)

    kls = [mean(teacher_divergence_BxN(student, p, tokens, attn, s_cfg=STUDENT, t_cfg=c, n_response=N))
           for p, c in zip(TEACHERS, (T_A, T_B))]
    one = divergence(Routing.one("teacher", ("arithmetic", "counting")), (T_A,), TEACHERS[:1])
    np.testing.assert_array_equal(one, kls[0])
    by_task = divergence(resolve_routing(_cfg(*MIX, *TWO), 1, 1), (T_A, T_B), TEACHERS)
    np.testing.assert_array_equal(by_task, np.where(task == 0, kls[0], kls[1]))
    routing = resolve_routing(_cfg(*MIX, *TWO, "routing=mixture"), 1, 1)
    unowned = dataclasses.replace(routing, owner=(None, None))  # every row against the mixture
    mixed = divergence(unowned, (T_A, T_B), TEACHERS)
    want = mean(mixture_divergence_BxN(student, TEACHERS, tokens, attn, s_cfg=STUDENT, t_cfgs=(T_A, T_B),
                                       log_weights=routing.log_weights, n_response=N))
    np.testing.assert_array_equal(mixed, want)
    assert not np.array_equal(want, kls[0]) and not np.array_equal(want, kls[1])

