"""`train.compute_dtype: bf16`, the mixed-precision trainer: fp32 master weights and optimizer state, bf16 matmuls
accumulated in fp32 (the step's own jaxpr), fp32 logits and loss within bf16's tolerance of the fp32 step, and the
exact mismatch measured in the update's numerics (0 against a bf16 sampler of the same code)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.config_dataclass import ConfigError
from jopd.models.config import ModelConfig
from jopd.opd.resolve import student_compute_dtype, teacher_compute_dtype
from jopd.opd.step import build_step
from jopd.opd.student_loss import rollout_loss_fn
from jopd.parallel import mesh as M
from jopd.run.config import load_config
from tests.helpers.bf16_tolerance import bf16_rel_rms_tolerance
from tests.helpers.tiny_params import numpy_params

CFG = ModelConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=8, eos_token_id=None)
B, P, N = 16, 5, 12
BASE = [f"data.batch_size={B}", f"data.max_prompt_len={P}", f"sampling.max_new_tokens={N}", "train.mismatch=exact",
        "mesh.data=1", "mesh.fsdp=1", "loss.kind=topk_rkl", "loss.top_k=8"]


def bf16_setup():
    """A bf16 trainer and a bf16 sampler (`rollout_precision.compute_dtype=bf16`, fp32 logits) of the tiny model:
    (cfg, step, state, teacher params, one prompt batch)."""
    cfg = load_config(None, BASE + ["train.compute_dtype=bf16", "rollout_precision.compute_dtype=bf16"])
    step = build_step(cfg, CFG, (CFG,), M.make_mesh(cfg.mesh, jax.devices()[:1]))
    state = step.init_state(numpy_params(CFG, seed=0, std=0.5))
    teacher = jax.device_put((numpy_params(CFG, seed=1, std=0.5),), step.shardings.teacher)
    rng = np.random.default_rng(0)
    batch = {"prompt_tokens": rng.integers(1, CFG.vocab_size, (B, P)).astype(np.int32),
             "prompt_mask": np.ones((B, P), np.int32)}
    return cfg, step, state, teacher, batch


def test_compute_dtype_is_validated_and_resolved():
    with pytest.raises(ConfigError, match=r"^RunConfig\.train\.compute_dtype: [^\n]*$"):
        load_config(None, BASE + ["train.compute_dtype=fp16"])
    cases = {("fp32", "fp32"): jnp.float32, ("fp32", "bf16"): jnp.bfloat16, ("bf16", "fp32"): jnp.bfloat16,
             ("bf16", "bf16"): jnp.bfloat16}
    for (student, compute), want in cases.items():
        cfg = load_config(None, BASE + [f"student.dtype={student}", f"train.compute_dtype={compute}",
                                        "teacher.dtype=bf16"])
        assert student_compute_dtype(cfg) == want  # a bf16 student computes in bf16 either way
        assert teacher_compute_dtype(cfg) == {"fp32": jnp.float32, "bf16": jnp.bfloat16}[compute]  # storage aside


def _dots(jaxpr):
    """Every dot_general of a jaxpr, nested jaxprs (scan, checkpoint, jit) included: (lhs, rhs, out) dtypes."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(tuple(str(v.aval.dtype) for v in (*eqn.invars, *eqn.outvars)))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _dots(sub)
    return out


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def test_bf16_step_is_fp32_within_bf16_tolerance_with_fp32_state_and_bf16_matmuls():
    cfg, step, state, teacher, batch = bf16_setup()
    assert step.compute_dtype == jnp.bfloat16
    with jax.set_mesh(step.mesh):
        rollout = step.rollout(state, batch, 0)
        scored = step.score(teacher, rollout)

    # loss and gradient: the function the update differentiates, in bf16 and in fp32, on the same scored batch
    fp32, bf16 = (jax.jit(jax.value_and_grad(rollout_loss_fn(CFG, step.loss_cfg, d), has_aux=True))
                  for d in (jnp.float32, jnp.bfloat16))
    (loss32, _), g32 = fp32(state.params, scored)
    (loss16, _), g16 = bf16(state.params, scored)
    # bf16's logit error (tests/helpers/bf16_tolerance.py: 3 u sqrt(2L), u = 2^-8) bounds the loss's relative
    # error. A gradient leaf's relative error e is a cosine >= sqrt(1 - e^2): the global cosine >= 0.99 allows
    # e <= 0.14, and each leaf is held to 0.1 (about 25 u: the backward pass rounds as many activations again, and
    # with these large weights the attention's bf16-rounded scores dominate: measured <= 0.061, cosine 0.9994)
    tol = bf16_rel_rms_tolerance(CFG.num_layers)
    assert float(loss32) > 0.1 and abs(float(loss16) / float(loss32) - 1) <= tol

    def within(g, ref):
        leaves = all(np.linalg.norm(np.asarray(x, np.float64) - r) <= 0.1 * np.linalg.norm(r)
                     for r, x in zip(jax.tree.leaves(ref), jax.tree.leaves(g)))
        a, b = _flat(ref), _flat(g)
        return leaves and a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) >= 0.99

    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g16))  # the master weights' gradient
    assert within(g16, g32)
    # the check discriminates: the fp32 gradient with one row of 16 scored against another row's teacher is out
    lb = scored.loss
    wrong = scored.replace(loss=lb.replace(**{f: getattr(lb, f).at[0].set(getattr(lb, f)[1]) for f in (
        "teacher_topk_ids_BxTxK", "teacher_topk_logprobs_BxTxK")}))
    assert not within(fp32(state.params, wrong)[1], g32)

    # the matmuls are bf16: the update's and the scoring's projections take bf16 operands into fp32 results
    with jax.set_mesh(step.mesh):
        update_dots = _dots(jax.make_jaxpr(step.update_fn)(state, scored).jaxpr)
        score_dots = _dots(jax.make_jaxpr(step.score_fn)(teacher, rollout.arrays).jaxpr)
    for dots in (update_dots, score_dots):
        # 7 projections of the layer + the LM head (and the support logits' gathered rows in the update)
        assert dots.count(("bfloat16", "bfloat16", "float32")) >= 8

    # fp32 master weights and optimizer state after a bf16 step
    with jax.set_mesh(step.mesh):
        new, metrics = step.update(state, scored)
    assert float(metrics["nonfinite"]) == 0
    floats = [x for x in jax.tree.leaves((new.params, new.opt_state)) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert len(floats) > 2 * len(jax.tree.leaves(new.params)) and all(x.dtype == jnp.float32 for x in floats)


def test_exact_mismatch_is_the_updates_zero_against_a_bf16_sampler_of_the_same_code():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, JOPD_XLA_DEFAULTS="0")
    out = subprocess.run([sys.executable, str(root / "tests" / "helpers" / "bf16_mismatch_worker.py")], env=env,
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    kl = json.loads(out.stdout.strip().splitlines()[-1])
    # the lab (`jopd mismatch`) and the update's own metric: fp32's floor (tests/lab/test_mismatch_measure.py) ...
    assert abs(kl["lab"]) <= 1e-6 and abs(kl["update"]) <= 1e-6
    # ... where an fp32 trainer, on the same bf16 rollout, measures bf16's rounding
    assert kl["fp32_trainer"] > 1e-5
