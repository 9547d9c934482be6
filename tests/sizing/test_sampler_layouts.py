"""`jopd aot --sampler-layouts`: the weight sync and the sampler compiled under each candidate `sampling.mesh` on
the same devices (here the 8 host CPU devices, priced on v5e's peaks), one row per candidate, the fastest that
fits marked; a candidate the run refuses is a row with its error."""

import json

import pytest

from jopd.cli import main
from jopd.config_dataclass import ConfigError
from jopd.run.config import load_config
from jopd.sizing import aot
from jopd.sizing.report import layout_table

# the testbed student with 2 kv heads (tensor=2 divides its heads); the toy vocabulary (103 ids) is replicated
TINY = ["data.batch_size=8", "data.max_prompt_len=16", "sampling.max_new_tokens=8", "loss.top_k=8",
        "student.arch.num_layers=1", "teacher.arch.num_layers=1", "student.arch.num_kv_heads=2", "mesh.data=1",
        "mesh.fsdp=8"]
CANDIDATES = "trainer ; data=-1,tensor=2,on_indivisible=replicate ; tensor=3"


def test_one_row_per_layout_and_the_fastest_marked():
    rows = aot.compare_sampler_layouts(load_config(None, TINY), aot.parse_sampler_layouts(CANDIDATES),
                                       progress=False, cost=True, chip="v5e")
    trainer, split, refused = rows
    assert [s.name for s in trainer.report.stages] == list(aot.LAYOUT_STAGES)
    assert trainer.sampler_mesh == {"data": 1, "fsdp": 8, "tensor": 1}
    assert split.sampler_mesh == {"data": 4, "fsdp": 1, "tensor": 2}
    assert refused.report is None and refused.error.startswith("sampling.mesh.tensor=3: does not divide the 8")
    # the rollout weights: whole on every device on the trainer's mesh (the SAMPLE rules), split over tensor=2
    whole, halved = (r.report.buffers["sampler_params"] for r in (trainer, split))
    assert halved < whole
    assert all(r.fits and r.seconds > 0 and r.peak_per_chip > 0 for r in (trainer, split))
    table = layout_table(rows).splitlines()
    assert len([ln for ln in table if ln.startswith(("trainer ", "data=-1", "tensor=3 "))]) == 3
    best = min((trainer, split), key=lambda r: r.seconds)
    marked = [ln for ln in table if ln.endswith("<- fastest")]
    assert len(marked) == 1 and marked[0].startswith(best.name + " ")
    assert any("tensor=3: sampling.mesh.tensor=3" in ln for ln in table)


def test_cli_prints_each_layout_and_the_table(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("mesh:\n  data: 1\n  fsdp: 8\n")
    out = tmp_path / "layouts.json"
    assert main(["aot", str(cfg), *TINY, "--sampler-layouts", "trainer ; data=2,tensor=4,on_indivisible=replicate",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== sampler layout trainer ==" in text and "sampler mesh data=2 fsdp=1 tensor=4" in text
    assert "sampler layouts (sampling.mesh)" in text and "no roofline" in text  # local devices: no time to rank
    assert "teacher_scoring" not in text  # only the stages a sampler layout changes
    report = json.loads(out.read_text())
    assert list(report) == ["trainer", "data=2,tensor=4,on_indivisible=replicate"]
    assert report["data=2,tensor=4,on_indivisible=replicate"]["sampler_mesh"] == {"data": 2, "fsdp": 1, "tensor": 4}


@pytest.mark.parametrize("text, message", [
    ("data=-1 ; tensor", r"--sampler-layouts: 'tensor' in 'tensor' is not axis=size"),
    ("data=two", r"--sampler-layouts: 'data=two' in 'data=two' is not axis=size"),
    ("stage=2", r"--sampler-layouts 'stage=2'.stage: unknown key"),
    (" ; ", r"--sampler-layouts: no candidate given"),
])
def test_bad_layout_syntax_is_one_line(text, message):
    with pytest.raises(ConfigError, match=message):
        aot.parse_sampler_layouts(text)
