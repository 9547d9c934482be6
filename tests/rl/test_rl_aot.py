"""`jopd aot` lowers the RL step's extra pieces: the reference params (the sixth argument of score_fn when
loss.kl_coef > 0) and the running-mean baseline's train state."""

from jopd.sizing import aot
from jopd.run.config import load_config

TINY = ["data.batch_size=8", "data.max_prompt_len=16", "sampling.max_new_tokens=8", "loss.top_k=8",
        "student.arch.num_layers=1", "teacher.arch.num_layers=1", "rl.group_size=2"]


def test_aot_lowers_the_reference_and_the_running_baseline_state():
    grpo = aot.compile_opd_step(load_config(None, TINY + ["loss.kind=grpo", "loss.kl_coef=0.05", "rl.inner_updates=2"]),
                                stages=("teacher_scoring", "train_step"), progress=False)
    assert [s.error for s in grpo.stages] == [None, None] and grpo.shapes["batch"] == 16
    # the reference is one copy of the params; the train state holds three (params, Adam's two moments) + scalars
    assert 0 <= grpo.buffers["train_state"] - 3 * grpo.buffers["reference_params"] < 1024
    scoring, train = grpo.stages
    assert "reference_params" in train.resident and "reference_params" not in scoring.resident  # an argument there
    running = aot.compile_opd_step(load_config(None, TINY + ["loss.kind=reinforce", "rl.baseline=running_mean"]),
                                   stages=("train_step",), progress=False)
    assert running.stages[0].error is None and "reference_params" not in running.buffers
