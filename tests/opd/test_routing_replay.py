"""`train.routing_replay` in the update (`opd.student_loss.rollout_loss_fn`) of a mixture-of-experts student:
replaying the trainer's own routing changes no bit of the loss, the gradient or the metrics; replaying another
choice changes the forward, and the routing-flip metrics count it as numpy does; a dense student refuses the
setting in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import log_softmax

from jopd.losses import LossBatch, LossConfig
from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from jopd.opd.batch import TrainBatch
from jopd.opd.packing import pack_tokens, plan_packing
from jopd.opd.student_loss import rollout_loss_fn
from tests.helpers.tiny_params import numpy_params

CFG = ModelConfig(family="qwen3_moe", vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=8, norm_topk_prob=True)
B, P, N = 4, 5, 6


def _batch(params):
    """A prompt + response batch (left-padded prompts, responses of several lengths) whose recorded routing is the
    trainer's own, recorded where a sampler records it (real prompt tokens, response tokens but the last)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (B, P + N)).astype(np.int32)
    lengths = np.array([6, 3, 1, 5])
    prompt_mask = np.ones((B, P), bool)
    prompt_mask[0, :2] = False
    mask = np.concatenate([prompt_mask, np.arange(N)[None] < lengths[:, None]], 1)
    _, _, own = jax.jit(lambda t, m: T.forward(params, t, cfg=CFG, attn_mask_BxT=m, return_routing=True))(tokens, mask)
    recorded = np.concatenate([prompt_mask, np.arange(N)[None] < lengths[:, None] - 1], 1)
    ids = np.where(recorded[:, :, None, None], np.moveaxis(np.asarray(own), 0, 2), -1).astype(np.int16)
    sampler_full = log_softmax(rng.normal(size=(B, N, CFG.vocab_size)), -1).astype(np.float32)
    loss = LossBatch(targets_BxT=tokens[:, P:], response_mask_BxT=mask[:, P:],
                     sampler_logprobs_BxT=np.take_along_axis(sampler_full, tokens[:, P:, None], -1)[..., 0],
                     sampler_full_logprobs_BxTxV=sampler_full)
    return TrainBatch(tokens_BxS=tokens, attn_mask_BxS=mask, loss=loss, sampler_experts_BxSxLsxk=ids,
                      replay_B=np.ones(B, bool)), recorded


def test_replaying_the_trainers_own_routing_changes_no_bit_and_another_is_counted():
    params = numpy_params(CFG, seed=1, std=0.5)
    batch, recorded = _batch(params)
    update = jax.jit(jax.value_and_grad(rollout_loss_fn(CFG, LossConfig(kind="sft", chunk_size=4)), has_aux=True))
    (loss_r, metrics_r), grads_r = update(params, batch)
    (loss, metrics), grads = update(params, batch.replace(replay_B=np.zeros(B, bool)))
    assert float(loss) == float(loss_r) and set(metrics) == set(metrics_r)
    for k in metrics:
        assert np.asarray(metrics[k]).tobytes() == np.asarray(metrics_r[k]).tobytes(), k
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), grads, grads_r)
    assert metrics["mismatch_router_flip_frac"] == 0.0 and metrics["mismatch_token_flip_frac"] == 0.0
    assert metrics["mismatch_kl"] > 0.1 and float(jnp.abs(grads["layers"]["router"]).max()) > 0

    # another choice: in a few tokens and layers, the two experts the trainer ranks last
    ids = np.asarray(batch.sampler_experts_BxSxLsxk).copy()
    rng = np.random.default_rng(5)
    forced = recorded[:, :, None] & (rng.random((B, P + N, 2)) < 0.3)  # [B, S, Ls]
    ranked_last = np.array([[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]])  # the complement of each pair
    for b, s, l in zip(*np.nonzero(forced)):
        ids[b, s, l] = next(p for p in ranked_last if not set(p) & set(ids[b, s, l]))
    (loss_f, metrics_f), _ = update(params, batch.replace(sampler_experts_BxSxLsxk=ids))
    assert float(loss_f) != float(loss)
    # the flips the metrics count: the trainer's own choice on the replayed forward against the replayed ids
    _, _, own = T.forward(params, batch.tokens_BxS, cfg=CFG, attn_mask_BxT=batch.attn_mask_BxS, return_routing=True,
                          replay_experts_LsxBxTxk=jnp.moveaxis(jnp.asarray(ids), 2, 0))
    differ = np.any(np.sort(np.moveaxis(np.asarray(own), 0, 2), -1) != np.sort(ids, -1), -1) & recorded[:, :, None]
    assert differ.sum() >= forced.sum() > 0  # every forced decision is a flip (later layers may flip on their own)
    n = recorded.sum()
    assert float(metrics_f["mismatch_router_flip_frac"]) == pytest.approx(differ.sum() / (2 * n), rel=1e-6)
    assert float(metrics_f["mismatch_token_flip_frac"]) == pytest.approx(differ.any(-1).sum() / n, rel=1e-6)

    # packed rows (`train.pack`): the recorded and replayed ids follow their tokens into the packed layout
    plan = plan_packing(recorded[:, :P].sum(1), np.array([6, 3, 1, 5]), P, N, width=2 * (P + N))
    packed = batch.replace(sampler_experts_BxSxLsxk=ids, tokens_BxS=pack_tokens(batch.tokens_BxS, plan),
                           attn_mask_BxS=plan.segment_BpxC > 0, plan=plan,
                           loss=batch.loss.replace(compact=plan.compact))
    assert plan.segment_BpxC.shape[0] < B  # sequences share rows
    (loss_p, metrics_p), _ = update(params, packed)
    assert float(loss_p) == pytest.approx(float(loss_f), rel=1e-5)
    for k in ("mismatch_router_flip_frac", "mismatch_token_flip_frac"):
        assert float(metrics_p[k]) == float(metrics_f[k])


def test_routing_replay_with_a_dense_student_is_refused():
    from jopd.opd.step import build_step
    from jopd.opd.validate import check_models
    from jopd.parallel import mesh as M
    from jopd.run.config import load_config

    dense = ModelConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=8)
    cfg = load_config(None, ["train.routing_replay=true", "mesh.data=1", "mesh.fsdp=1", "loss.top_k=8"])
    error = (r"^RunConfig.train.routing_replay: the student \(llama\) has no mixture-of-experts layer whose routing "
             r"to replay; set it false$")
    with pytest.raises(ValueError, match=error):  # before any weight is read (`model_sources.precheck_sources`)
        check_models(cfg, dense, [dense], [False])
    with pytest.raises(ValueError, match=error):
        build_step(cfg, dense, (dense,), M.make_mesh(cfg.mesh, jax.devices()[:1]))
    check_models(cfg, CFG, [CFG], [False])  # a mixture-of-experts student replays
