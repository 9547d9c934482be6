"""Run by tests/opd/test_mixed_precision.py in its own process, with XLA's own CPU dots (jopd's YNNPACK default
off: its fused bf16 programs round differently from one program to the next) and excess precision off: a bf16
sampler and a bf16 trainer of the same code then compute the same numbers. Prints one JSON line: the exact
mismatch the lab measures (`jopd mismatch`'s `measure`, trainer side in the update's dtype), the bf16 update's own
`mismatch_kl`, and the fp32 trainer's against the same bf16 rollout."""

import json
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.helpers.xla_test_flags import with_fast_compile

    os.environ["XLA_FLAGS"] = with_fast_compile("--xla_allow_excess_precision=false")
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import jax.numpy as jnp

    from jopd.lab import mismatch as measure
    from jopd.opd.student_loss import rollout_loss_fn
    from jopd.run.loop import OPDRun
    from tests.opd.test_mixed_precision import bf16_setup

    cfg, step, state, teacher, batch = bf16_setup()
    with jax.set_mesh(step.mesh):
        scored = step.score(teacher, step.rollout(state, batch, 0))
        rep = measure.measure(OPDRun(cfg, step, teacher_params=None, tokenizer=None), state, [batch], resamples=50,
                              progress=False)
        fp32 = jax.jit(rollout_loss_fn(step.student_cfg, step.loss_cfg, jnp.float32))(state.params, scored)[1]
        update = step.update(state, scored)[1]  # donates the state
    print(json.dumps({"lab": rep.exact_kl.mean, "update": float(update["mismatch_kl"]),
                      "fp32_trainer": float(fp32["mismatch_kl"])}))
