"""`jopd aot`: the AOT machinery on the 8 host CPU devices (the code path a TPU topology takes, with other
devices), the real architectures' configs, and, when libtpu is installed, a real TPU topology."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.sizing import aot, arch, stages, topology
from jopd.sizing.report import check_fits
from jopd.cli import main
from jopd.run.config import ModelSource, load_config
from jopd.models import io

ROOT = Path(__file__).resolve().parents[2]
# Tiny testbed models (toy vocabulary), small step: every stage of the trainer, compiled in seconds.
TINY = ["data.batch_size=8", "data.max_prompt_len=16", "sampling.max_new_tokens=8", "loss.top_k=8",
        "student.arch.num_layers=1", "teacher.arch.num_layers=1"]


def tiny_cfg(*overrides):
    return load_config(None, [*TINY, *overrides])


@pytest.fixture(scope="module")
def fsdp8():
    return aot.compile_opd_step(tiny_cfg("mesh.data=1", "mesh.fsdp=8"), progress=False)


def test_every_stage_compiles_from_abstract_inputs(fsdp8):
    assert [s.name for s in fsdp8.stages] == list(aot.STAGES)
    assert fsdp8.num_devices == 8 and fsdp8.mesh == {"data": 1, "fsdp": 8, "tensor": 1}
    for s in fsdp8.stages:
        m = s.memory
        assert s.error is None and m is not None
        assert m.argument > 0 and m.output > 0 and min(m.alias, m.temp, m.generated_code) >= 0
        assert m.total == m.argument + m.output - m.alias + m.temp + m.generated_code
        assert s.peak == m.total + sum(s.resident.values())
    d = json.loads(fsdp8.to_json())
    assert set(d["stages"][0]["memory"]) == {"argument", "output", "alias", "temp", "generated_code", "total"}
    assert fsdp8.hbm_per_device is None and d["fits"] is True  # CPU: HBM unknown, nothing to exceed
    tight = dataclasses.replace(fsdp8, hbm_per_device=1024)  # the same programs against a 1 KiB budget
    assert json.loads(tight.to_json())["fits"] is False and len(tight.failures()) == len(aot.STAGES)
    table = fsdp8.table()
    assert all(name in table for name in aot.STAGES) and "argument" in table


def test_compiled_sizes_match_shapes_and_shardings(fsdp8):
    """XLA's per-device sizes against bytes computed independently from shapes and shardings."""
    from jopd import parallel as meshlib
    from jopd.models import transformer

    cfg = tiny_cfg("mesh.data=1", "mesh.fsdp=8")
    model = arch.model_config_of(cfg.student, "student")
    mesh = meshlib.make_mesh(cfg.mesh)
    shapes = transformer.abstract_params(model)
    train_bytes = meshlib.sharded_bytes_per_device(shapes, meshlib.param_shardings(model, mesh, meshlib.TRAIN_RULES))
    sample_bytes = meshlib.sharded_bytes_per_device(shapes, meshlib.param_shardings(model, mesh, meshlib.SAMPLE_RULES))
    assert sample_bytes == sum(x.size * 4 for x in jax.tree.leaves(shapes))  # sampling: replicated over fsdp
    stage = {s.name: s.memory for s in fsdp8.stages}
    b = fsdp8.buffers
    assert 3 * train_bytes < b["train_state"] <= 3 * train_bytes + 64  # params, Adam mu and nu; a few scalars
    assert b["sampler_params"] == sample_bytes
    assert stage["weight_sync"].argument == train_bytes  # the trainer params (jit drops the unused noise key)
    n_leaves = len(jax.tree.leaves(shapes))
    assert sample_bytes <= stage["weight_sync"].output <= sample_bytes + 8 * n_leaves  # + the output tuple's table
    assert stage["train_step"].alias == b["train_state"]  # the donated state is updated in place


def test_fsdp_splits_the_per_device_memory(fsdp8):
    data8 = aot.compile_opd_step(tiny_cfg("mesh.data=8", "mesh.fsdp=1"), stages=["train_step"], progress=False)
    m1, m8 = data8.stages[0].memory, next(s.memory for s in fsdp8.stages if s.name == "train_step")
    assert data8.buffers["train_state"] > 7 * fsdp8.buffers["train_state"]  # params + moments split 8 ways
    assert m8.argument < m1.argument and m8.total < m1.total


def test_scoring_neither_takes_nor_copies_the_samplers_full_logprobs():
    """train.mismatch=exact: the sampler's [B, N, V] log-softmax goes from the sampler straight to the train step.
    Were it a scoring argument, the jitted pass-through would write a copy into a new output buffer (3.9 GiB per
    chip on the Llama v5e config); instead it is held (counted once) while the scoring runs."""
    cfg = tiny_cfg("mesh.data=1", "mesh.fsdp=8", "train.mismatch=exact")
    V = arch.model_config_of(cfg.student, "student").vocab_size
    full = cfg.data.batch_size // 8 * cfg.sampling.max_new_tokens * V * 4  # fp32 bytes per device, rows over 8
    r = aot.compile_opd_step(cfg, stages=["teacher_scoring", "train_step"], progress=False)
    scoring, train = r.stages
    assert scoring.resident["rollout"] == full  # the rollout's part that is not a scoring argument
    assert scoring.memory.output < full  # no [B, N, V] among the scoring's outputs
    assert scoring.memory.argument - r.buffers["teacher_params"] < full  # nor among its arguments
    plain = aot.compile_opd_step(tiny_cfg("mesh.data=1", "mesh.fsdp=8", "train.mismatch=estimators"),
                                 stages=["train_step"], progress=False)
    assert train.memory.argument - plain.stages[0].memory.argument >= full  # the train step reads it


def test_hbm_check_names_the_stage(fsdp8):
    check_fits(fsdp8)  # unknown HBM: no check
    small = dataclasses.replace(fsdp8, hbm_per_device=next(s.peak for s in fsdp8.stages if s.name == "sample"))
    with pytest.raises(ValueError, match=r"stage (teacher_scoring|train_step|weight_sync): needs .* GiB HBM"):
        check_fits(small)
    assert "sample: needs" not in "; ".join(small.failures())  # exactly at the budget fits


def test_compiler_refusal_is_a_failed_stage():
    class Refuses:
        def compile(self):
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                               "temporaries (211.12G) exceeds available HBM (15.75G).")

    compiled, _, error = stages.compile_stage("train_step", lambda: Refuses())
    assert compiled is None and "211.12G" in error

    class Broken:
        def compile(self):
            raise RuntimeError("INVALID_ARGUMENT: something else")

    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):
        stages.compile_stage("train_step", lambda: Broken())


# Published sizes: Llama 3.1 8B and 3.2 1B exactly; Qwen3 model cards give total and non-embedding counts.
ARCHS = {
    "llama-3.1-8b-instruct": (8_030_261_248, None),
    "llama-3.2-1b-instruct": (1_235_814_400, None),
    "qwen3-8b": (8.2e9, 6.95e9),
    "qwen3-1.7b": (1.7e9, 1.4e9),
    "qwen3-30b-a3b": (30.5e9, 29.9e9),  # model card: 30.5B in total (3.3B activated), 29.9B non-embedding
}


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_real_architectures_from_config_json_alone(name):
    cfg = arch.model_config_of(ModelSource(path=str(ROOT / "configs" / "arch" / name)), "student")
    total, non_embedding = ARCHS[name]
    n = arch.param_count(cfg)
    if non_embedding is None:
        assert n == total
    else:
        embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        assert round(n / 1e9, 1) == round(total / 1e9, 1)
        assert round((n - embeddings) / 1e9, 2 if name == "qwen3-8b" else 1) == non_embedding / 1e9


def test_missing_model_path_names_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"RunConfig\.teacher\.path: .*nope does not exist"):
        arch.model_config_of(ModelSource(path=str(tmp_path / "nope")), "teacher")


def test_real_configs_validate():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(str(path))
        for src in (cfg.student, *cfg.teacher_sources()):
            if src.path is not None and src.path.startswith("configs/arch/"):
                assert (ROOT / src.path / "config.json").is_file(), path
            elif src.path is not None:  # a built-in model name (e.g. smollm2-135m-instruct)
                assert io.resolve_model_path(src.path).is_file(), path


def test_cli_report_json_and_hbm_failure(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("mesh:\n  data: 2\n  fsdp: 4\n")
    out = tmp_path / "report.json"
    assert main(["aot", str(cfg), *TINY, "--stages", "weight_sync", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
    assert [s["name"] for s in report["stages"]] == ["weight_sync"] and report["stages"][0]["memory"]["total"] > 0
    assert "weight_sync" in capsys.readouterr().out
    assert main(["aot", str(cfg), *TINY, "--stages", "weight_sync", "--hbm-gib", "1e-6"]) == 2
    assert "does not fit: stage weight_sync: needs" in capsys.readouterr().err
    assert main(["aot", str(cfg), *TINY, "--stages", "nope"]) == 2
    assert "stages: unknown ['nope']" in capsys.readouterr().err


def test_remat_and_batch_constraint_keep_the_gradient():
    """forward(remat=True) and the mesh-context batch constraint change memory, never values."""
    from jopd.parallel import mesh as meshlib
    from jopd.models import transformer
    from jopd.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    rng = np.random.default_rng(0)  # numpy init: no PRNG program to compile
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.2, s.shape), jnp.float32),
                          transformer.abstract_params(cfg))
    tokens = jnp.asarray(rng.integers(0, 64, (8, 12)), jnp.int32)

    def loss(p, remat):
        logits, _ = transformer.forward(p, tokens, cfg=cfg, remat=remat)
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g_ref = grad(params, False)
    mesh = meshlib.make_mesh(meshlib.MeshConfig(data=2, fsdp=4))
    with jax.set_mesh(mesh):  # a new trace, with the batch constraint applied
        g_new = grad(params, True)
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_new)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    # The constraint is in the program only under a mesh: the embedding output and the scanned layer's output,
    # batch over (data, fsdp), the other dims left to XLA ({?}).
    fwd = jax.jit(lambda p: transformer.forward(p, tokens, cfg=cfg)[0])
    assert "sharding_constraint" not in fwd.lower(params).as_text()
    with jax.set_mesh(mesh):
        constraints = [ln for ln in fwd.lower(params).as_text().splitlines() if "sharding_constraint" in ln]
    assert len(constraints) == 2 and all('[{"data", "fsdp"}, {?}, {?}]' in ln for ln in constraints)


def test_tpu_topology():
    """The same machinery on a real TPU topology (libtpu describes v5e chips; nothing runs on them)."""
    pytest.importorskip("libtpu")
    with pytest.raises(ValueError, match="--topology v9z:1x1: not a TPU topology"):
        topology.topology_devices("v9z:1x1")
    devices = topology.topology_devices("v5e:2x2")
    assert len(devices) == 4 and devices[0].device_kind == "TPU v5 lite"
    assert topology.hbm_bytes_per_device(devices) == 16 * topology.GiB
    report = aot.compile_opd_step(tiny_cfg("mesh.data=1", "mesh.fsdp=4"), devices, target="v5e:2x2",
                                  stages=["weight_sync", "train_step"], progress=False)
    assert report.hbm_per_device == 16 * topology.GiB and not report.failures()
    train = report.stages[1].memory
    # TPU pads small arrays to its (8, 128) tiles: the donated state takes at least its raw bytes.
    assert train.generated_code > 0 and train.alias >= report.buffers["train_state"]
    assert math.isclose(report.buffers["train_state"] * 4, aot.compile_opd_step(
        tiny_cfg("mesh.data=4", "mesh.fsdp=1"), devices, stages=["weight_sync"], progress=False
    ).buffers["train_state"], rel_tol=0.01)


def test_rl_baselines_lower_with_grouped_rows_and_advantages():
    """GRPO: every prompt sampled rl.group_size times; the loss reads per-token advantages (lowering only)."""
    from jopd.parallel import mesh as meshlib

    cfg = tiny_cfg("mesh.data=1", "mesh.fsdp=8", "loss.kind=grpo", "rl.group_size=2")
    s_cfg = arch.model_config_of(cfg.student, "student")
    programs, buffers = stages.stage_programs(cfg, s_cfg, (s_cfg,), meshlib.make_mesh(cfg.mesh))
    with jax.set_mesh(meshlib.make_mesh(cfg.mesh)):
        lowered = programs["train_step"][0]()
    batch = lowered.args_info[0][1]  # (args, kwargs): args = (state, batch)
    assert batch.loss.advantages_BxT.shape == (16, 8) and batch.tokens_BxS.shape == (16, 24)
    assert buffers["kv_cache"] > 0


# ---------------------------------------------------------------------------------------------
# TPU on paper: cost programs and the roofline


def test_chip_peaks_and_device_kinds():
    """The published per-chip peaks (bf16 dense FLOP/s, HBM bytes/s) and the device kinds that map to them."""
    from jopd.sizing import roofline

    assert {k: (p.flops, p.hbm_bytes_per_s) for k, p in roofline.CHIP_PEAKS.items()} == {
        "v4": (275e12, 1200e9), "v5e": (197e12, 819e9), "v5p": (459e12, 2765e9), "v6e": (918e12, 1638e9)}
    assert all(p.source == f"https://cloud.google.com/tpu/docs/{k}" for k, p in roofline.CHIP_PEAKS.items())
    assert {kind: roofline.chip_of(kind, topology.HBM_GIB_PER_CHIP) for kind in topology.HBM_GIB_PER_CHIP} == {
        kind: chip for kind, (chip, _) in topology.HBM_GIB_PER_CHIP.items()}
    assert roofline.chip_of("cpu", topology.HBM_GIB_PER_CHIP) is None
    with pytest.raises(ValueError, match="roofline: no chip peaks for 'cpu'"):  # before any compile
        aot.compile_opd_step(tiny_cfg(), cost=True, progress=False)


def test_cost_of_matmul_programs_by_hand():
    """XLA's cost of one matmul is analytic; a scan of 10 counts one (why the cost programs are loop-free); fp32
    matmuls at HIGHEST add 5 bf16 MXU passes; the roofline is max(FLOPs / peak, bytes / bandwidth) per device."""
    from jopd.sizing import roofline

    m, k, n = 64, 128, 256
    x, w = jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((k, n), jnp.float32)
    matmul = jax.jit(lambda x, w: jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST))
    lowered = matmul.lower(x, w)
    cost = roofline.Cost.of(lowered.compile(), lowered.as_text(), num_devices=1)
    assert cost.flops == 2 * m * k * n and cost.extra_pass_flops == 5 * 2 * m * k * n and cost.loops == 0
    assert cost.bytes == 4 * (m * k + k * n + m * n)
    peak = roofline.CHIP_PEAKS["v5e"]
    assert cost.seconds(peak) == (6 * 2 * m * k * n / 197e12, 4 * (m * k + k * n + m * n) / 819e9)
    assert cost.seconds(peak, devices_per_chip=2) == tuple(2 * s for s in cost.seconds(peak))

    bf16 = jax.jit(lambda x, w: x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).lower(x, w).as_text()
    assert roofline.dot_flops_by_passes(bf16) == {1: 2 * m * k * n}  # bf16 operands: one pass at any precision

    ws = jax.ShapeDtypeStruct((10, k, k), jnp.float32)
    scan = jax.jit(lambda x, ws: jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]).lower(x, ws).compile()
    looped = roofline.Cost.of(scan)
    assert looped.flops == pytest.approx(2 * m * k * k, abs=16) and looped.loops == 1  # ten matmuls, one counted
    # (+ the loop counter's few integer ops)


def test_a_programs_own_loops_are_counted_and_a_cpu_scatter_expansion_is_not():
    """XLA:CPU's loop emitters (the suite's compile flags) turn a scatter into a while loop: not a loop of the
    program's (a TPU scatters natively), so the roofline does not count it; a scan is one."""
    from jopd.sizing.roofline import program_loops

    x, idx = jnp.zeros((16, 4)), jnp.array([1, 3, 3, 7])
    scatter = jax.jit(lambda x, i: x.at[i].add(1.0)).lower(x, idx).compile().as_text()
    scan = jax.jit(lambda x: jax.lax.scan(lambda c, r: (c + r, c), x[0], x)[0]).lower(x).compile().as_text()
    both = jax.jit(lambda x, i: jax.lax.scan(lambda c, r: (c + r, c), x[0], x.at[i].add(1.0))[0]
                   ).lower(x, idx).compile().as_text()
    assert (program_loops(scatter), program_loops(scan), program_loops(both)) == (0, 1, 1)
    # two gathers' gradients: XLA merges their scatter-adds with the sum of the cotangents (named `add_any`)
    merged = jax.jit(jax.grad(lambda x, i: jnp.sum(x[i] ** 2) + jnp.sum(jnp.sin(x[i[::-1]])))).lower(x, idx)
    text = merged.compile().as_text()
    assert "while(" in text and program_loops(text) == 0


def test_roofline_arithmetic_by_hand():
    """Stage time = sum over its programs of runs x max(compute, HBM); step = sum of stages; tokens/s per chip and
    MFU from those, on made-up costs with round numbers."""
    from jopd.sizing.roofline import CHIP_PEAKS, Cost, Part, Roofline, StageCost

    peak = CHIP_PEAKS["v5e"]
    f, b = peak.flops, peak.hbm_bytes_per_s  # 1 s of compute, 1 s of HBM traffic per device
    sample = StageCost("sample", (Part("prefill", 1, Cost(0.5 * f, 0.1 * b)),  # 0.5 s, compute-bound
                                  Part("decode", 100, Cost(0.001 * f, 0.01 * b))))  # 100 x 0.01 s, HBM-bound
    train = StageCost("train_step", (Part("update", 1, Cost(0.2 * f, 0.05 * b, extra_pass_flops=1.0 * f)),))
    assert sample.seconds(peak) == pytest.approx((0.6, 1.1, 1.5)) and sample.bound(peak) == "HBM"
    assert train.seconds(peak) == pytest.approx((1.2, 0.05, 1.2)) and train.bound(peak) == "compute"
    r = Roofline(chip="v5e", peak=peak, num_devices=8, devices_per_chip=1, stages=[sample, train],
                 rollout_tokens=64 * 512, model_flops={"sample": 1e15, "train_step": 3e15}, compile_s=1.0)
    assert r.chips == 8 and r.step_s == pytest.approx(2.7)
    assert r.rollout_tokens_per_s_per_chip == pytest.approx(64 * 512 / (1.5 * 8))
    assert r.mfu == pytest.approx(4e15 / (2.7 * 8 * 197e12))
    d = r.to_dict()
    assert d["step_s"] == r.step_s and [s["bound"] for s in d["stages"]] == ["HBM", "compute"]
    assert d["stages"][0]["parts"][1] | {} == {"name": "decode", "count": 100, "compile_s": 0.0, "error": None,
                                              "flops": 0.001 * f, "bytes": 0.01 * b, "extra_pass_flops": 0.0,
                                              "loops": 0, "ici_bytes": 0.0, "ici_steps": 0.0}
    table = r.table()
    assert "prefill x1 + decode x100" in table and "predicted step 2.7 s" in table and "MFU" in table
    # two devices per chip: each device has half the chip's peaks
    assert dataclasses.replace(r, devices_per_chip=2).step_s == pytest.approx(5.4)
    refused = StageCost("train_step", (Part("update", 1, None, error="RESOURCE_EXHAUSTED"),))
    assert dataclasses.replace(r, stages=[sample, refused]).step_s is None


def _fwd_dot_flops(m, rows: int, positions: int) -> int:
    """Matmul FLOPs of a forward over `positions` per row, attending over all of them (no cache)."""
    D, H, K, Dh, F = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.intermediate_size
    per_token = 2 * (D * H * Dh + 2 * D * K * Dh + H * Dh * D + 3 * D * F)
    return m.num_layers * (rows * positions * per_token + 4 * rows * H * positions * positions * Dh)


@pytest.fixture(scope="module")
def costed():
    """3 layers and 2 loss chunks: the looped programs count one layer and one chunk, the cost programs all."""
    cfg = tiny_cfg("mesh.data=1", "mesh.fsdp=8", "student.arch.num_layers=3", "teacher.arch.num_layers=3",
                   "loss.chunk_size=4", "train.remat=true")
    return cfg, aot.compile_opd_step(cfg, progress=False, cost=True, chip="v5e")


@pytest.mark.slow
def test_cost_programs_count_every_layer_chunk_and_token(costed):
    cfg, report = costed
    looped = {s.name: s.cost for s in report.stages}
    cost = {s.name: s for s in report.roofline.stages}
    B, P, N = 8, 16, 8
    # the sampler: the looped program is the prefill + one decode step (the while body, counted once), so the cost
    # programs add the other N - 2 decode steps
    prefill, decode = cost["sample"].parts
    assert (prefill.name, prefill.count, decode.name, decode.count) == ("prefill", 1, "decode", N - 1)
    assert prefill.cost.flops + decode.cost.flops == pytest.approx(looped["sample"].flops, rel=1e-4)
    assert looped["sample"].loops >= 1 and prefill.cost.loops == decode.cost.loops == 0  # top_p=1: no bisection
    # teacher scoring: every layer, and the head of every response position (both chunks in the program, one after
    # the other), exactly: the fp32 teacher's matmuls are all HIGHEST, so their FLOPs are the extra passes / 5
    teacher = arch.model_config_of(cfg.teacher, "teacher")
    scoring = cost["teacher_scoring"]
    assert [(p.name, p.count, p.derived) for p in scoring.parts] == [("forward", 1, False)]
    dots = _fwd_dot_flops(teacher, B, P + N) + 2 * B * N * teacher.hidden_size * teacher.vocab_size
    assert scoring.total("extra_pass_flops") * 8 / 5 == dots  # 8 devices
    assert dots / 8 < scoring.total("flops") < 1.1 * dots / 8  # XLA's count: the matmuls + elementwise work
    assert looped["teacher_scoring"].flops < 0.5 * scoring.total("flops")  # one layer and one chunk counted
    # the update: forward + backward + the layers' recompute (remat), every layer
    student = arch.model_config_of(cfg.student, "student")
    update = cost["train_step"]
    assert [(p.name, p.count) for p in update.parts] == [("update", 1)]
    assert update.total("flops") > 3.5 * _fwd_dot_flops(student, B, P + N) / 8
    assert looped["train_step"].flops < 0.5 * update.total("flops")
    assert report.roofline.step_s > 0 and 0 < report.roofline.mfu < 1
    assert not any("while loop" in n for n in report.roofline.notes), report.roofline.notes  # every loop accounted for


@pytest.mark.slow
def test_the_prefill_part_is_the_prefill_program(costed):
    """The rollout's prefill part is the memory pass's sampler program minus one decode step (not compiled again):
    the same FLOPs, MXU passes and loops as the prefill program compiled on its own."""
    from jopd import parallel as meshlib
    from jopd.opd.step import build_step
    from jopd.sizing import cost as costmod
    from jopd.sizing.roofline import Cost

    cfg, report = costed
    s, t = arch.model_config_of(cfg.student, "student"), arch.model_config_of(cfg.teacher, "teacher")
    step = build_step(cfg, s, (t,), meshlib.make_mesh(cfg.mesh))
    ins = stages.step_inputs(step)
    with jax.set_mesh(step.mesh):
        lowered = costmod._rollout_programs(step, ins)["prefill"][1]()
        own = Cost.of(lowered.compile(), lowered.as_text(), 8)
    prefill = next(p for p in report.roofline.stages[1].parts if p.name == "prefill")
    assert prefill.cost.flops == pytest.approx(own.flops, rel=1e-4) and prefill.cost.loops == own.loops
    assert own.extra_pass_flops > 0 and prefill.cost.extra_pass_flops == pytest.approx(own.extra_pass_flops, rel=1e-6)
    assert prefill.cost.bytes == pytest.approx(own.bytes, rel=0.05)


@pytest.mark.slow
def test_cost_programs_equal_a_loop_free_real_step(monkeypatch):
    """One layer and one loss chunk: the real scoring and update hold no loop, so XLA's cost of them is exact. With
    two chunks, the cost programs cost the same: the chunks unrolled in one program, or (where the compiler refuses
    that program) the chunk loop's body counted once and the other chunk derived from the one-layer pair."""
    from jopd import parallel as meshlib
    from jopd.opd.step import build_step
    from jopd.sizing import cost as costmod

    base = ("mesh.data=1", "mesh.fsdp=8", "train.remat=true")
    stages_ = ["teacher_scoring", "train_step"]
    real = aot.compile_opd_step(tiny_cfg(*base), stages=stages_, progress=False).stages
    chunked = tiny_cfg(*base, "loss.chunk_size=4")
    report = aot.compile_opd_step(chunked, stages=stages_, progress=False, cost=True, chip="v5e")
    unrolled = report.roofline
    programs_of = costmod.cost_programs

    class Refused:  # a lowered program that XLA refuses, as one over the device's HBM
        def as_text(self):
            return ""

        def compile(self, **_):
            raise RuntimeError("RESOURCE_EXHAUSTED: stand-in")

    def refusing_unrolled(*args, **kwargs):
        programs = programs_of(*args, **kwargs)
        programs.lower.update({k: Refused for k in programs.lower if " unrolled" in k})
        return programs

    monkeypatch.setattr(costmod, "cost_programs", refusing_unrolled)
    # the fallback is one code path for both stages: the update's (the larger program) checks it, costed beside
    # the memory report already compiled above
    s_cfg, t_cfg = arch.model_config_of(chunked.student, "student"), arch.model_config_of(chunked.teacher, "teacher")
    step = build_step(chunked, s_cfg, (t_cfg,), meshlib.make_mesh(chunked.mesh))
    derived = costmod.predict_step(step, stages.step_inputs(step), report.stages[1:], "v5e", 8)
    for loop_free, stage in zip(real, unrolled.stages):
        assert loop_free.cost.loops == 0 and [p.derived for p in stage.parts] == [False]
        assert stage.total("flops") == pytest.approx(loop_free.cost.flops, rel=0.02)
        assert stage.total("bytes") == pytest.approx(loop_free.cost.bytes, rel=0.1)
    (update,) = derived.stages
    assert [p.derived for p in update.parts] == [False, True]
    assert update.total("flops") == pytest.approx(real[1].cost.flops, rel=0.02)
    assert update.total("bytes") == pytest.approx(real[1].cost.bytes, rel=0.1)
    assert sum("loss chunks unrolled did not compile (RESOURCE_EXHAUSTED: stand-in)" in n for n in derived.notes) == 1
    assert not any("did not compile" in n for n in unrolled.notes)


@pytest.mark.slow
def test_model_flops_and_json(costed):
    cfg, report = costed
    r = report.roofline
    s, t = arch.model_config_of(cfg.student, "student"), arch.model_config_of(cfg.teacher, "teacher")
    head = lambda m: m.hidden_size * m.vocab_size  # noqa: E731
    layers = lambda m: arch.param_count(m) - head(m) * (1 if m.tie_word_embeddings else 2) - m.hidden_size  # noqa: E731
    B, P, N = 8, 16, 8

    def attention(m, T):  # one forward's score and value matmuls: query i against keys 0..i, per head and layer
        return sum(2 * 2 * (i + 1) * m.head_dim * m.num_heads * m.num_layers for i in range(T))

    # a decode step feeding response token i - 1 attends to the prompt and the tokens up to it: P + i keys
    decode = sum(2 * 2 * (P + i) * s.head_dim * s.num_heads * s.num_layers for i in range(1, N))
    assert r.model_flops == pytest.approx({
        "weight_sync": 0.0,
        "sample": 2 * (layers(s) * (B * P + B * (N - 1)) + head(s) * B * N) + B * (attention(s, P) + decode),
        "teacher_scoring": 2 * (layers(t) * B * (P + N) + head(t) * B * N) + B * attention(t, P + N),
        "train_step": 6 * (layers(s) * B * (P + N) + head(s) * B * N) + 3 * B * attention(s, P + N)}, rel=1e-12)
    d = json.loads(report.to_json())["roofline"]
    assert d["chip"] == "v5e" and d["chips"] == 8 and d["rollout_tokens"] == B * N
    assert [s["name"] for s in d["stages"]] == list(aot.STAGES) and d["step_s"] == pytest.approx(r.step_s)
    assert d["rollout_tokens_per_s_per_chip"] == pytest.approx(B * N / (r.stage_seconds("sample") * 8))


@pytest.mark.slow
def test_cli_prints_the_roofline_for_a_topology(tmp_path, capsys):
    pytest.importorskip("libtpu")
    cfg = tmp_path / "run.yaml"
    cfg.write_text("mesh:\n  data: 1\n  fsdp: 4\n")
    out = tmp_path / "report.json"
    assert main(["aot", str(cfg), *TINY, "--topology", "v5e:2x2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "per-device memory" in text and "roofline on 4 x v5e (197 TFLOP/s bf16, 819 GB/s HBM per chip" in text
    assert "prefill x1 + decode x7" in text and "predicted step" in text and "tok/s per chip" in text
    assert "MFU" in text and "cost programs: " in text and "programs at once (--compile-threads)" in text
    report = json.loads(out.read_text())
    assert report["roofline"]["chip"] == "v5e" and report["roofline"]["step_s"] > 0
    # a fresh process (libtpu initializes there) without what this one set (`topology.compile_only_env`): the
    # report is all it prints, none of libtpu's warnings about the host's TPU metadata
    env = {k: v for k, v in os.environ.items() if k not in topology.compile_only_env("v5e:2x2")}
    run = subprocess.run([sys.executable, "-m", "jopd.cli", "aot", str(cfg), *TINY, "--topology", "v5e:2x2",
                          "--stages", "weight_sync", "--no-cost"], capture_output=True, text=True, cwd=ROOT,
                         env=env | {"PYTHONPATH": str(ROOT)}, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "per-device memory" in run.stdout and "roofline" not in run.stdout
    assert not [ln for ln in (run.stdout + run.stderr).splitlines()
                if ln.startswith("E0000") or "WARNING: could not determine" in ln or "InitGoogle" in ln]


# ---- a teacher with another tokenizer ----


def _cross_batch_bytes_per_row(prompt_len, new_tokens):
    """`OPDStep._align`'s arrays per rollout row, from their layout: the teacher's prompt (ids, mask) and
    response (ids, mask, span ids: new_tokens + 4 slots), the student's span ids and the per-span arrays (start
    positions on both sides, mask, end-span flag), and the aligned flag."""
    Nt = new_tokens + 4
    return prompt_len * (4 + 1) + Nt * (4 + 1 + 4) + new_tokens * (4 + 4 + 4 + 1 + 1) + 1


def test_cross_tokenizer_step_lowers_with_the_teachers_rows_and_projection_table():
    """The toy student and a testbed teacher with SmolLM2's tokenizer (49152 ids): the run's own table (from the
    tokenizers), its bytes held beside the scoring program, the teacher's rows an argument of the scoring."""
    cfg = tiny_cfg("mesh.data=8", "loss.kind=xtok_dense", f"teacher.tokenizer={io.smollm2_gguf_path()}",
                   "teacher.arch.hidden_size=16", "teacher.arch.intermediate_size=32")
    report = aot.compile_opd_step(cfg, stages=["teacher_scoring"], progress=False)
    assert report.models["teacher"]["vocab"] == 49152 and report.models["student"]["vocab"] == 103
    E = int(report.shapes["xtok_pairs"])  # an exact count: no "(estimated ...)"
    assert report.shapes["cross_tokenizer"] == "dense" and 0 < E < 4 * 49152
    assert report.buffers["projection_table"] == 4 * (49152 * 4 + 1 + 2 * 103 + 3 * E)
    assert report.buffers["cross_batch"] == (8 // 8) * _cross_batch_bytes_per_row(16, 8)
    (scoring,) = report.stages
    assert scoring.error is None and scoring.resident["projection_table"] == report.buffers["projection_table"]
    assert scoring.memory.argument >= report.buffers["teacher_params"] + report.buffers["cross_batch"]


def test_cross_tokenizer_pair_from_config_json_alone_sizes_with_a_stand_in_table():
    """Config-only model directories have no tokenizer: a stand-in table of the vocabulary sizes (4 sparse
    entries per teacher id, said to be an estimate) lowers the scoring; a vocabulary mismatch without
    a cross-tokenizer loss.kind still names the field to set."""
    arch = ROOT / "configs" / "arch"
    base = [*TINY, "mesh.data=8", f"teacher.path={arch / 'smollm2-135m-instruct'}", "teacher.num_layers=1",
            f"student.path={arch / 'qwen3-1.7b'}", "student.num_layers=1"]
    report = aot.compile_opd_step(load_config(None, [*base, "loss.kind=xtok_sampled"]),
                                  stages=["teacher_scoring"], progress=False)
    Vs, Vt = 151936, 49152
    assert report.models["student"]["vocab"] == Vs and report.models["teacher"]["vocab"] == Vt
    assert report.shapes["xtok_pairs"] == f"{4 * Vt} (estimated: no tokenizer)"
    assert report.buffers["projection_table"] == 4 * (Vt * 4 + 1 + 2 * Vs + 3 * 4 * Vt)
    assert report.stages[0].error is None and report.stages[0].memory.argument > report.buffers["cross_batch"] > 0
    with pytest.raises(ValueError, match=r"^teacher/student vocab mismatch: .* set loss.kind=xtok_dense or xtok_sampled"):
        aot.compile_opd_step(load_config(None, base), stages=["teacher_scoring"], progress=False)


def _two_teachers(first: tuple[str, str], second: tuple[str, str], width: int, *overrides: str):
    """A tiny run mixing arithmetic and counting, each routed to its own teacher: (name, extra YAML fields)."""
    arch = f"arch: {{num_layers: 1, hidden_size: {width}, intermediate_size: {2 * width}}}"
    (a, a_extra), (b, b_extra) = first, second
    teachers = (f"teachers=[{{name: {a}, tasks: [arithmetic], {arch}{a_extra}}}, "
                f"{{name: {b}, tasks: [counting], {arch}{b_extra}}}]")
    return load_config(None, [*TINY[:5], "data.batch_size=16", "data.mix={arithmetic: 1, counting: 1}", teachers,
                              *overrides])


def test_each_teacher_is_sized_by_its_placement():
    """Two teachers on 8 fsdp devices, the second `placement: replicated`: its bytes per device are its whole
    size, the first's its FSDP shard (both from the shapes and shardings, independently of XLA)."""
    from jopd import parallel as meshlib
    from jopd.models import transformer

    cfg = _two_teachers(("a", ""), ("b", ", placement: replicated"), 32, "mesh.data=1", "mesh.fsdp=8")
    report = aot.compile_opd_step(cfg, stages=["teacher_scoring"], progress=False)
    t_cfg = arch.model_config_of(cfg.teachers[0], "teachers[0]")
    shapes = transformer.abstract_params(t_cfg)
    whole = sum(x.size * 4 for x in jax.tree.leaves(shapes))
    fsdp = meshlib.sharded_bytes_per_device(shapes, meshlib.param_shardings(t_cfg, meshlib.make_mesh(cfg.mesh),
                                                                            meshlib.TRAIN_RULES))
    a, b = report.models["a"], report.models["b"]
    assert (a["placement"], b["placement"]) == ("fsdp", "replicated")
    assert b["bytes_per_device"] == whole and a["bytes_per_device"] == fsdp < whole / 4
    assert report.buffers["teacher_params"] == whole + fsdp
    assert report.stages[0].error is None and report.stages[0].memory.argument >= whole + fsdp
    assert "b: llama" in report.table() and "replicated (" in report.table()


def test_a_teacher_with_another_tokenizer_among_several_holds_the_only_projection_table():
    """A toy-vocabulary teacher beside one with SmolLM2's tokenizer (routed by task): one projection table (the
    cross teacher's, as if it were alone), the teachers' rows' span arrays, both teachers' params."""
    cfg = _two_teachers(("same", ""), ("smol", f", tokenizer: '{io.smollm2_gguf_path()}'"), 16,
                        "loss.kind=xtok_dense", "mesh.data=8")
    report = aot.compile_opd_step(cfg, stages=["teacher_scoring"], progress=False)
    assert report.models["smol"]["vocab"] == 49152 and report.models["same"]["vocab"] == 103
    name, E = report.shapes["xtok_pairs"].split(": ")
    assert name == "smol" and 0 < int(E) < 4 * 49152
    assert report.buffers["projection_table"] == 4 * (49152 * 4 + 1 + 2 * 103 + 3 * int(E))
    assert report.buffers["cross_batch"] == (16 // 8) * _cross_batch_bytes_per_row(16, 8)
    assert report.buffers["teacher_params"] == report.models["same"]["bytes_per_device"] + \
        report.models["smol"]["bytes_per_device"]
    (scoring,) = report.stages
    assert scoring.error is None and scoring.resident["projection_table"] == report.buffers["projection_table"]


def test_staleness_window_is_held_beside_the_update_not_its_argument():
    """`rollout.staleness: k`: the train step takes the state without its window (`split_window`); the window is
    held beside it, so the step's peak grows by the window's bytes (k copies of the params) and nothing else."""
    plain = aot.compile_opd_step(tiny_cfg(), stages=["train_step"], progress=False)
    lagged = aot.compile_opd_step(tiny_cfg("rollout.staleness=2"), stages=["train_step"], progress=False)
    (p,), (s,) = plain.stages, lagged.stages
    from jopd.sizing.arch import model_config_of, param_count
    params = param_count(model_config_of(tiny_cfg().student, "student")) * 4  # fp32
    assert s.error is None and s.resident["policy_window"] == 2 * params
    assert s.peak == p.peak + s.resident["policy_window"]
    assert lagged.buffers["train_state"] == plain.buffers["train_state"] + s.resident["policy_window"]
