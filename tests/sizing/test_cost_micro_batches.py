"""The update's cost with gradient accumulation (`optim.grad_accum_steps`): one micro-batch's program, run that many
times (`sizing.cost.micro_batches`), not the whole batch in one program (which needs every micro-batch's
activations at once and may not fit a chip where the real step does)."""

import pytest

from jopd.run.config import load_config
from jopd.sizing import aot

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
    assert micro["loss chunk"].count == 2 * whole["loss chunk"].count
    # half the rows per program: about half its FLOPs (each also holds the optimizer update: ~3% here)
    assert micro["update"].cost.flops == pytest.approx(whole["update"].cost.flops / 2, rel=0.05)
    total = lambda parts: sum(p.count * p.cost.flops for p in parts.values() if p.cost)  # noqa: E731
    assert total(micro) == pytest.approx(total(whole), rel=0.05)
    assert any("costed as 2 micro-batches" in n for n in notes)
    # micro-batches that do not split over the batch shards: the whole batch in one program, and said so
    odd, notes = _update("data.batch_size=8", "optim.grad_accum_steps=2")  # 4 rows: not over 8 shards
    assert odd["update"].count == 1 and any("costed as one batch" in n for n in notes)
