"""`jopd aot` of `rollout.placement=disaggregated` (`opd.placement`): the sampler's stages (weight sync, sample)
compiled on its own devices and the trainer's on the rest, each side's memory with only its own buffers held, the
weight transfer and the rollout's copy back counted as ICI traffic, and the step predicted as the longer side when
`rollout.staleness` >= 1 lets the two run at once."""

import dataclasses

import jax
import pytest

from jopd.run.config import load_config
from jopd.sizing import aot, arch, stages, topology
from jopd.opd.step import build_step
from jopd.parallel import mesh as meshlib
from jopd.opd import placement

TINY = ["data.batch_size=8", "data.max_prompt_len=16", "sampling.max_new_tokens=8", "loss.top_k=8",
        "student.arch.num_layers=1", "teacher.arch.num_layers=1", "mesh.data=4"]
SPLIT = ["rollout.placement=disaggregated", "rollout.sampler_devices=4", "rollout.staleness=1"]


@pytest.fixture(scope="module")
def split():
    cfg = load_config(None, TINY + SPLIT)
    return cfg, aot.compile_opd_step(cfg, progress=False, cost=True, chip="v5e")


@pytest.mark.slow
def test_each_side_holds_its_own_buffers_and_the_transfer_is_the_fp32_policy(split):
    cfg, report = split
    assert report.sampler_devices == 4 and report.num_devices == 8 and not report.failures()
    assert "disaggregated: the sampler (weight_sync, sample) on devices 0..3" in report.table()
    s_cfg = arch.model_config_of(cfg.student, "student")
    # the sampler's mesh {data: 4} replicates the params: each sampler device receives the whole fp32 policy
    assert report.buffers["weight_transfer"] == 4 * arch.param_count(s_cfg)
    held = {s.name: set(s.resident) for s in report.stages}
    assert held["sample"] == set() and held["weight_sync"] == {"kv_cache"}  # no trainer state on the sampler's side
    assert "sampler_params" not in held["teacher_scoring"] and "kv_cache" not in held["teacher_scoring"]
    assert "kv_cache" not in held["train_step"] and "teacher_params" in held["train_step"]


@pytest.mark.slow
def test_the_step_is_the_longer_side_and_the_rollout_per_device_doubles_on_half_the_devices(split):
    cfg, report = split
    r = report.roofline
    sampler_side, trainer_side = r.side_seconds()
    assert r.sampler_stages == ("weight_sync", "sample") and r.sampler_devices == 4 and r.sides_overlap
    assert sampler_side == pytest.approx(r.stage_seconds("weight_sync") + r.stage_seconds("sample"))
    assert trainer_side == pytest.approx(r.stage_seconds("teacher_scoring") + r.stage_seconds("train_step"))
    assert r.step_s == pytest.approx(max(sampler_side, trainer_side))
    assert dataclasses.replace(r, sides_overlap=False).step_s == pytest.approx(sampler_side + trainer_side)
    assert r.step_tokens_per_s_per_chip == pytest.approx(8 * 8 / (r.step_s * 8))
    parts = {p.name: p.cost for s in r.stages for p in s.parts}
    assert parts["weight transfer"].ici_bytes == report.buffers["weight_transfer"]
    # the rollout back: all of it, split over the 4 sampler devices = its bytes per trainer device (4, batch-split)
    assert parts["rollout back"].ici_bytes == pytest.approx(report.buffers["rollout"], rel=0.01)
    # the same rollout on all 8 devices (colocated): the same total work, so twice the FLOPs per device on 4
    colocated = aot.compile_opd_step(load_config(None, TINY[:-1] + ["mesh.data=8"]), stages=["sample"],
                                     progress=False, cost=True, chip="v5e").roofline.stages[0]
    sample = next(s for s in r.stages if s.name == "sample")
    assert sample.total("flops") == pytest.approx(2 * colocated.total("flops"), rel=0.05)


def test_the_sampler_side_is_compiled_for_the_sampler_devices():
    """The weight sync's program takes the policy as the transfer leaves it on devices 0..3 and the train step's
    its state on 4..7 (lowered and compiled for the local devices)."""
    cfg = load_config(None, TINY + SPLIT)
    s_cfg, t_cfg = (arch.model_config_of(src, role) for src, role in ((cfg.student, "student"),
                                                                      (cfg.teacher, "teacher")))
    trainer, own = placement.split_devices(cfg, jax.devices())
    step = build_step(cfg, s_cfg, (t_cfg,), meshlib.make_mesh(cfg.mesh, trainer), devices=jax.devices())
    assert step.devices == jax.devices()[:4] + jax.devices()[4:] and set(own) == set(jax.devices()[:4])
    programs, _ = stages.programs_of(step, stages.step_inputs(step))
    with jax.set_mesh(step.sampler_mesh):
        sync = programs["weight_sync"][0]().compile()
    assert {d for s in jax.tree.leaves(sync.input_shardings) for d in s.device_set} == set(own)


def test_a_split_of_a_tpu_topology():
    """On a v5e:2x2 (libtpu describes it; nothing runs): the sampler's devices are found among the topology's, not
    the host's CPU devices."""
    pytest.importorskip("libtpu")
    devices = topology.topology_devices("v5e:2x2")
    cfg = load_config(None, [*TINY[:-1], "mesh.data=2", "rollout.placement=disaggregated",
                             "rollout.sampler_devices=2"])
    report = aot.compile_opd_step(cfg, devices, target="v5e:2x2", stages=["weight_sync"], progress=False)
    assert report.sampler_devices == 2 and report.mesh["data"] == 2 and not report.failures()
    with pytest.raises(ValueError, match=r"^rollout.sampler_devices=4: must be between 1 and 3"):
        aot.compile_opd_step(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, sampler_devices=4)),
                             devices, stages=["weight_sync"], progress=False)
