"""Expert parallelism (`mesh.expert`, `moe.expert_parallel_swiglu`) and the router's load-balancing loss
(`loss.router_aux_coef`): on 8 simulated devices with the experts split 4 ways, the forward and the update's loss and
gradient equal one device's, no device holds (or gathers) every expert's weights; the load-balancing loss equals
transformers' `load_balancing_loss_func` on the same router logits; the settings a model cannot honour are refused."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from jax.sharding import NamedSharding, PartitionSpec as P

from jopd.losses import LossBatch, LossConfig
from jopd.models import io, moe
from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from jopd.opd.batch import TrainBatch
from jopd.opd.student_loss import rollout_loss_fn
from jopd import parallel as meshlib
from tests.helpers.hf_models import make_hf_model, right_padded_batch
from tests.helpers.tiny_params import numpy_params

# E=8 experts of width I=12 in D=16: distinct sizes, so an expert leaf's shape is recognizable in the compiled HLO
CFG = ModelConfig(family="qwen3_moe", vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=8, qk_norm=True, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=12, norm_topk_prob=True)
B, P_, N = 8, 5, 6
EXPERT_LEAVES = ("expert_gate", "expert_up", "expert_down")


def _mesh(**sizes):
    return meshlib.make_mesh(meshlib.MeshConfig(**sizes))


def _rel(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def _batch(replay: bool):
    """Prompt + response rows (left-padded prompts, responses of several lengths) with recorded routing: k
    distinct random experts per real token and sparse layer (a replayed forward runs them)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (B, P_ + N)).astype(np.int32)
    lengths = rng.integers(1, N + 1, B)
    prompt_mask = np.arange(P_)[None] >= rng.integers(0, 3, (B, 1))
    mask = np.concatenate([prompt_mask, np.arange(N)[None] < lengths[:, None]], 1)
    Ls, k = len(CFG.sparse_layers), CFG.num_experts_per_tok
    ids = np.argsort(rng.random((B, P_ + N, Ls, CFG.num_experts)), -1)[..., :k]  # [B, S, Ls, k]
    ids = np.where(mask[:, :, None, None], ids, -1).astype(np.int16)
    targets = tokens[:, P_:]
    loss = LossBatch(targets_BxT=targets, response_mask_BxT=mask[:, P_:])
    return TrainBatch(tokens_BxS=tokens, attn_mask_BxS=mask, loss=loss, sampler_experts_BxSxLsxk=ids,
                      replay_B=np.full(B, replay))


def _hlo_gathers_every_expert(text: str) -> bool:
    """Whether an all-gather in the compiled program produces an array holding all E experts of a leaf."""
    E, D, I = CFG.num_experts, CFG.hidden_size, CFG.moe_intermediate_size
    for shape in re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather\(", text):
        dims = tuple(int(d) for d in shape.split(",") if d)
        if any(dims[i:i + 3] in ((E, D, I), (E, I, D)) for i in range(len(dims))):
            return True
    return False


def test_expert_parallel_update_equals_one_device_and_splits_the_experts():
    """The update's loss (sft + router_aux_coef, replayed routing) and its gradient on a (data 2, expert 4) mesh
    equal one device's; every expert leaf and its gradient hold 2 of the 8 experts per device, and the compiled
    program never all-gathers a whole expert leaf (the tokens travel, not the weights)."""
    params = numpy_params(CFG, seed=1, std=0.5)
    batch = _batch(replay=True)
    loss_cfg = LossConfig(kind="sft", chunk_size=4, router_aux_coef=0.1)
    grad_fn = jax.value_and_grad(rollout_loss_fn(CFG, loss_cfg), has_aux=True)
    (loss1, metrics1), grads1 = jax.jit(grad_fn)(params, batch)

    mesh = _mesh(data=2, expert=4)
    assert dict(mesh.shape) == dict(data=2, fsdp=1, expert=4, tensor=1)
    rules = meshlib.rules_for("train")
    p_sh = meshlib.param_shardings(CFG, mesh, rules)
    b_sh = jax.tree.map(lambda x: NamedSharding(mesh, P(("data", "fsdp", "expert"))), batch)
    assert meshlib.batch_sharding(mesh, rules, (B, P_ + N)).spec == P(("data", "fsdp", "expert"), None)
    assert p_sh["layers"]["expert_gate"].spec == P(None, "expert", "fsdp", "tensor")
    assert p_sh["layers"]["router"].spec == P(None, ("fsdp", "expert"), None)  # its E columns whole
    with jax.set_mesh(mesh):
        args = (jax.device_put(params, p_sh), jax.device_put(batch, b_sh))
        step = jax.jit(grad_fn, in_shardings=(p_sh, b_sh)).lower(*args).compile()
        (loss8, metrics8), grads8 = step(*args)
        text = step.as_text()
    assert float(metrics1["router_aux_loss"]) > 1.0  # k=2 when balanced; a coef that moves the loss
    assert abs(float(loss8) - float(loss1)) <= 1e-5 * abs(float(loss1))
    for k in metrics1:
        np.testing.assert_allclose(float(metrics8[k]), float(metrics1[k]), rtol=1e-5, err_msg=k)
    for path, g8 in jax.tree_util.tree_leaves_with_path(grads8):
        g1 = grads1
        for key in path:
            g1 = g1[key.key]
        assert _rel(g8, g1) <= 2e-5, path

    E = CFG.num_experts
    for name in EXPERT_LEAVES:
        for leaf in (args[0]["layers"][name], grads8["layers"][name]):
            assert {s.data.shape[1] for s in leaf.addressable_shards} == {E // 4}
    abstract = T.abstract_params(CFG)["layers"]
    per_device = meshlib.sharded_bytes_per_device([abstract[n] for n in EXPERT_LEAVES],
                                                  [p_sh["layers"][n] for n in EXPERT_LEAVES])
    assert per_device * 4 == sum(abstract[n].size * 4 for n in EXPERT_LEAVES)
    assert "all-gather" in text and "reduce-scatter" in text  # the tokens' gather and the outputs' sum
    assert not _hlo_gathers_every_expert(text)
    # the check above would see a gathered leaf: the same program with the experts replicated gathers nothing,
    # and one that constrains a leaf whole inside does
    def whole(p):
        return jax.lax.with_sharding_constraint(p["layers"]["expert_up"], P()).sum()
    with jax.set_mesh(mesh):
        assert _hlo_gathers_every_expert(jax.jit(whole, in_shardings=(p_sh,)).lower(args[0]).compile().as_text())


def test_expert_parallel_forward_equals_one_device_with_rows_the_expert_axis_cannot_split():
    """The cached (unrolled) forward of a mixed dense/sparse schedule with 2 rows on a (data 2, expert 4) mesh: the
    rows go over `data` only, each expert shard runs its experts on every row and a psum adds them up; the logits
    and every router's choice equal one device's."""
    cfg = ModelConfig(
        family="qwen3_moe", vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2,
        num_kv_heads=1, head_dim=8, qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
        norm_topk_prob=False, mlp_only_layers=(1,))
    params = numpy_params(cfg, seed=3, std=0.5)
    tokens = np.random.default_rng(1).integers(0, 37, (2, 7)).astype(np.int32)

    def fwd(p, t):
        return T.forward(p, t, cfg=cfg, return_routing=True)

    logits1, _, ids1 = jax.jit(fwd)(params, tokens)
    mesh = _mesh(data=2, expert=4)
    p_sh = meshlib.param_shardings(cfg, mesh, meshlib.rules_for("sample"))
    with jax.set_mesh(mesh):
        logits8, _, ids8 = jax.jit(fwd, in_shardings=(p_sh, NamedSharding(mesh, P("data"))))(
            jax.device_put(params, p_sh), tokens)
    assert _rel(logits8, logits1) <= 1e-5
    np.testing.assert_array_equal(ids8, ids1)


def test_load_balancing_loss_matches_transformers_per_layer():
    """Each sparse layer's `router_aux_mask_BxT` value from the forward against transformers'
    `load_balancing_loss_func` on that layer's router logits (transformers' own forward, `output_router_logits`)
    with the same token mask (the checkpoint also loads into an expert split, bit for bit); and one layer's value
    against numpy."""
    import tempfile

    model = make_hf_model("qwen3_moe", seed=2)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        cfg, params = io.load_params(tmp)
        # a checkpoint loads straight into the expert split (each device reading its own experts' tensors)
        sh = meshlib.param_shardings(cfg, _mesh(data=2, expert=4), meshlib.rules_for("train"))
        _, split = io.load_params(tmp, shardings=sh)
    assert split["layers"]["expert_up"].sharding == sh["layers"]["expert_up"]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), split, params)
    toks, mask = right_padded_batch(cfg.vocab_size)
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(toks), attention_mask=torch.as_tensor(mask.astype(np.int64)),
                    position_ids=torch.as_tensor(np.asarray(T.positions_from_mask(jnp.asarray(mask)), np.int64)),
                    output_router_logits=True)
    lbl = transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func
    tmask = torch.as_tensor(mask.astype(np.int64))
    ref = [float(lbl((logits,), cfg.num_experts, cfg.num_experts_per_tok, tmask)) for logits in out.router_logits]
    assert len(ref) == len(cfg.sparse_layers) == 2
    _, _, aux = jax.jit(lambda t, m: T.forward(params, t, cfg=cfg, attn_mask_BxT=m, router_aux_mask_BxT=m))(toks, mask)
    np.testing.assert_allclose(np.asarray(aux), ref, rtol=1e-5)
    assert min(ref) > cfg.num_experts_per_tok  # an untrained router is not balanced: the loss is above k

    # numpy: one layer's formula on random probabilities (f counts the top-k, P the mean probability)
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(6), 10)
    m = rng.random(10) < 0.7
    ids = np.argsort(-probs, 1)[:, :3]
    f = np.array([np.sum((ids == e).any(1) & m) for e in range(6)]) / m.sum()
    P_e = probs[m].mean(0)
    got = moe.load_balancing_loss(jnp.asarray(probs, jnp.float32), jnp.asarray(ids), jnp.asarray(m))
    assert float(got) == pytest.approx(6 * np.sum(f * P_e), rel=1e-5)


def test_router_aux_coef_zero_computes_nothing_and_adds_to_the_loss():
    """coef 0: no metric, the loss and gradient bit for bit the same program's; coef c: loss + c * aux."""
    params = numpy_params(CFG, seed=1, std=0.5)
    batch = _batch(replay=False)
    run = lambda c: jax.jit(rollout_loss_fn(CFG, LossConfig(kind="sft", chunk_size=4, router_aux_coef=c)))  # noqa
    loss0, m0 = run(0.0)(params, batch)
    loss1, m1 = run(0.5)(params, batch)
    assert "router_aux_loss" not in m0
    assert float(loss1) == pytest.approx(float(loss0) + 0.5 * float(m1["router_aux_loss"]), rel=1e-6)


def test_expert_settings_are_refused_in_one_line():
    from jopd.opd.validate import check_experts
    from jopd.run.config import load_config

    dense = ModelConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match=r"^RunConfig.mesh.expert=4: no model \(student llama, or a teacher\) has a "
                                         r"mixture-of-experts layer whose experts to split; set it 1$"):
        check_experts(load_config(None, ["mesh.expert=4", "mesh.data=2"]), dense, (dense,))
    check_experts(load_config(None, ["mesh.expert=4", "mesh.data=2"]), dense, (CFG,))  # a MoE teacher's experts
    with pytest.raises(ValueError, match=r"^RunConfig.mesh.expert=3: does not divide the student's num_experts=8$"):
        check_experts(load_config(None, ["mesh.expert=3", "mesh.data=1"]), CFG)
    with pytest.raises(ValueError, match=r"^RunConfig.loss.router_aux_coef=0.01: the student \(llama\) has no "
                                         r"router to balance; set it 0$"):
        check_experts(load_config(None, ["loss.router_aux_coef=0.01"]), dense)
    with pytest.raises(ValueError, match=r"loss.router_aux_coef=0.01: not with train.pack"):
        load_config(None, ["loss.router_aux_coef=0.01", "train.pack=true"])
    check_experts(load_config(None, ["mesh.expert=4", "loss.router_aux_coef=0.01"]), CFG)  # fine
    # the default mesh keeps its three axes (its programs unchanged); an expert split of 1 is the same mesh
    assert _mesh().axis_names == _mesh(expert=1).axis_names == ("data", "fsdp", "tensor")
    with pytest.raises(ValueError, match=r"^mesh.expert=3: does not divide the model's num_experts=8$"):
        with jax.set_mesh(meshlib.make_mesh(meshlib.MeshConfig(data=1, expert=3), jax.devices()[:3])):
            h = jnp.zeros((3, 1, 16))
            moe.expert_parallel_swiglu(h, jnp.zeros((3, 1, 2), jnp.int32), jnp.zeros((3, 1, 2)),
                                       *(jnp.zeros((8, 16, 12)),) * 2, jnp.zeros((8, 12, 16)), dtype=jnp.float32)


@pytest.mark.slow  # two production steps compiled (sampler, scoring, update), one on 8 devices: ~20 s
def test_opd_step_with_expert_parallelism_equals_one_device():
    """The production step (`build_step`: rollout, teacher scoring, update with routing replay and the router's
    loss) with a mixture-of-experts student and teacher on a (data 2, expert 4) mesh against one device: the same
    sampled tokens and recorded experts, the same loss, metrics and updated parameters; the student's experts and
    their Adam moments 2 of 8 per device, the batch over data x expert."""
    from jopd.opd.step import build_step
    from jopd.run.config import load_config

    Bs = 8
    params, teacher = numpy_params(CFG, seed=0, std=0.5), numpy_params(CFG, seed=7, std=0.5)  # a teacher apart
    rng = np.random.default_rng(2)
    prompts = {"prompt_tokens": rng.integers(1, CFG.vocab_size, (Bs, P_)).astype(np.int32),
               "prompt_mask": np.ones((Bs, P_), np.int32)}
    results = {}
    for name, sizes, devices in (("one", ["mesh.data=1"], jax.devices()[:1]),
                                 ("ep", ["mesh.data=2", "mesh.expert=4"], jax.devices())):
        cfg = load_config(None, [f"data.batch_size={Bs}", f"data.max_prompt_len={P_}", f"sampling.max_new_tokens={N}",
                                 "loss.kind=topk_rkl", "loss.top_k=8", "train.routing_replay=true",
                                 "loss.router_aux_coef=0.05", "optim.learning_rate=1e-2", "optim.warmup_steps=0",
                                 *sizes])
        step = build_step(cfg, CFG, (CFG,), meshlib.make_mesh(cfg.mesh, devices))
        with jax.set_mesh(step.mesh):
            rollout = step.rollout(step.init_state(params), prompts, 0)
            scored = step.score((teacher,), rollout)
            state, metrics = step.update(step.init_state(params), scored)
        results[name] = (step, jax.device_get(rollout.sample), jax.device_get(metrics), state)
    (_, s1, m1, st1), (step8, s8, m8, st8) = results["one"], results["ep"]
    np.testing.assert_array_equal(s8.tokens_BxN, s1.tokens_BxN)
    np.testing.assert_array_equal(s8.expert_ids_BxSxLsxk, s1.expert_ids_BxSxLsxk)
    assert float(m1["router_aux_loss"]) > 1.0 and float(m1["loss"]) > 0
    for k in ("loss", "router_aux_loss", "mismatch_kl", "num_tokens", "mismatch_router_flip_frac"):
        np.testing.assert_allclose(float(m8[k]), float(m1[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    p1, p8 = jax.device_get(st1.params), jax.device_get(st8.params)
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), p1, params)
    assert max(jax.tree.leaves(moved)) > 1e-3  # the update moved the params
    # Adam's first step is lr * g / (|g| + eps): compared as a tree norm (a rounding-level change of a near-zero
    # gradient entry can move its step by a part of lr)
    assert optax.tree.norm(jax.tree.map(np.subtract, p8, p1)) <= 1e-4 * optax.tree.norm(jax.tree.map(np.subtract,
                                                                                                     p1, params))
    assert step8.shardings.batch.spec == P(("data", "fsdp", "expert"))
    for leaf in (st8.params["layers"]["expert_down"], st8.opt_state[1][0].mu["layers"]["expert_down"]):
        assert {s.data.shape[1] for s in leaf.addressable_shards} == {CFG.num_experts // 4}


def test_dense_weights_split_over_fsdp_and_expert_and_expert_leaves_keep_their_split():
    """Under fsdp 2 x expert 4 a dense weight's embed dim goes over both axes (a dense student beside a MoE teacher
    is not replicated over the expert groups); an expert leaf's experts take `expert`, its embed `fsdp` alone."""
    from jopd.parallel import param_shardings, rules_for

    mesh = _mesh(fsdp=2, expert=4)
    dense = ModelConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8)
    specs = jax.tree.map(lambda s: s.spec, param_shardings(dense, mesh, rules_for("train")))
    assert specs["embed"] == P("tensor", ("fsdp", "expert"))
    assert specs["layers"]["q"] == P(None, ("fsdp", "expert"), "tensor", None)
    moe_specs = jax.tree.map(lambda s: s.spec, param_shardings(CFG, mesh, rules_for("train")))
    layer = moe_specs["layers"]
    assert layer["expert_gate"] == P(None, "expert", "fsdp", "tensor")
    assert layer["router"] == P(None, ("fsdp", "expert"), None)  # the router's embed dim; its experts stay whole
