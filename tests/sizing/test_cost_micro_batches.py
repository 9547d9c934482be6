"""The update's cost with gradient accumulation (`optim.grad_accum_steps`): one micro-batch's program, run that many
times (`sizing.cost.micro_batches`), not the whole batch in one program (which needs every micro-batch's
activations at once and may not fit a chip where the real step does)."""

import pytest

from jopd.run.config import load_config
from jopd.opd.step import build_step
from jopd.parallel import mesh as meshlib
from jopd.sizing import aot, arch, cost

TINY = ["data.batch_size=64", "data.max_prompt_len=16", "sampling.max_new_tokens=8", "loss.top_k=8",
        "student.arch.num_layers=1", "teacher.arch.num_layers=1", "mesh.data=8", "loss.chunk_size=4"]


def _update(*over):
    report = aot.compile_opd_step(load_config(None, [*TINY, *over]), stages=["train_step"], progress=False,
                                  cost=True, chip="v5e")
    (stage,) = report.roofline.stages
    return {p.name: p for p in stage.parts}, report.roofline.notes


@pytest.mark.slow
def test_accumulated_update_is_costed_as_its_micro_batches():
    whole, _ = _update()
    micro, notes = _update("optim.grad_accum_steps=2")
    assert (whole["update"].count, micro["update"].count) == (1, 2)
    # half the rows per program: about half its FLOPs (each also holds the optimizer update: ~3% here)
    assert micro["update"].cost.flops == pytest.approx(whole["update"].cost.flops / 2, rel=0.05)
    total = lambda parts: sum(p.count * p.cost.flops for p in parts.values() if p.cost)  # noqa: E731
    assert total(micro) == pytest.approx(total(whole), rel=0.05)
    assert any("costed as 2 micro-batches" in n for n in notes)

def test_micro_batches_that_do_not_split_over_the_shards_are_costed_as_one_batch():
    def split(*over):
        cfg = load_config(None, [*TINY, *over])
        s_cfg, t_cfg = (arch.model_config_of(src, role) for src, role in ((cfg.student, "student"),
                                                                          (cfg.teacher, "teacher")))
        return cost.micro_batches(build_step(cfg, s_cfg, (t_cfg,), meshlib.make_mesh(cfg.mesh)))

    assert split("optim.grad_accum_steps=4") == 4 and split() == 1
    assert split("data.batch_size=8", "optim.grad_accum_steps=2") == 1  # 4 rows per micro-batch, 8 batch shards
    assert split("data.batch_size=12", "sampling.samples_per_prompt=2", "optim.grad_accum_steps=8") == 1  # 12 % 8
