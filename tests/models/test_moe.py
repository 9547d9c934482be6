"""The Qwen3-MoE family against transformers' `Qwen3MoeForCausalLM` (random tiny checkpoints, fp32): the trainer's
logits and every token's router choices in every layer, the sampler's log-probs (prefill + cached greedy decode
steps), a mixed dense/sparse schedule read from sharded safetensors, and the export round trip; the grouped-matmul
dispatch and its gradient against a dense every-expert formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jopd.models import io, moe
from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from jopd.models.hf_io import INDEX_FILE
from jopd.sampling import decode
from jopd.sampling.config import SamplingConfig, row_randomness
from jopd.sampling.precision import PrecisionConfig
from tests.helpers.hf_models import make_hf_model, right_padded_batch
from tests.helpers.tiny_params import numpy_params

REL = 1e-5  # max |Δ| relative to the largest |value| compared (fp32)
# 3 layers, the middle one dense (mlp_only_layers), renormalized top-2 of 8; tied head
MIXED = dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True, tie_word_embeddings=True)


def _hf_run(model, tokens_BxT, mask_BxT, positions_BxT):
    """transformers' logits and each sparse layer's router choices [Ls, B*T, k] (forward hooks on the routers)."""
    chosen, hooks = [], []
    for layer in model.model.layers:
        if isinstance(layer.mlp, transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock):
            hooks.append(layer.mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[2].numpy())))
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(tokens_BxT), attention_mask=torch.as_tensor(mask_BxT.astype(np.int64)),
                    position_ids=torch.as_tensor(np.asarray(positions_BxT, np.int64)))
    for h in hooks:
        h.remove()
    return out.logits.float().numpy(), np.stack(chosen)


def _checkpoint(case, tmp):
    model = make_hf_model("qwen3_moe", seed=2, **(MIXED if case == "mixed" else {}))
    model.save_pretrained(tmp, max_shard_size="20KB")  # several safetensors files and an index
    return model


@pytest.mark.parametrize("case", ["all_sparse", "mixed"])
def test_logits_and_router_choices_match_transformers(case, tmp_path):
    model = _checkpoint(case, tmp_path)
    assert (tmp_path / INDEX_FILE).exists() and len(list(tmp_path.glob("model-*.safetensors"))) > 3
    cfg, params = io.load_params(tmp_path)
    assert cfg.sparse_layers == ((0, 2) if case == "mixed" else (0, 1))
    assert isinstance(params["layers"], tuple) == (case == "mixed")  # mixed: per-layer dicts, run unrolled
    toks, mask = right_padded_batch(cfg.vocab_size)
    positions = T.positions_from_mask(jnp.asarray(mask))
    logits, _, ids = T.forward(params, jnp.asarray(toks), cfg=cfg, attn_mask_BxT=jnp.asarray(mask),
                               return_routing=True)
    ref_logits, ref_ids = _hf_run(model, toks, mask, positions)
    delta, scale = float(np.abs(np.asarray(logits) - ref_logits)[mask].max()), float(np.abs(ref_logits[mask]).max())
    print(f"\n[moe parity] {case}: max|Δlogit| = {delta:.2e} (max|logit| = {scale:.1f})")
    assert delta <= REL * scale
    Ls, B, T_, k = ids.shape
    assert (Ls, k) == (len(cfg.sparse_layers), cfg.num_experts_per_tok)
    ids = np.asarray(ids).reshape(Ls, B * T_, k)
    real = mask.reshape(-1)
    np.testing.assert_array_equal(ids[:, real], ref_ids[:, real])  # every real token, every sparse layer, in order
    assert len(np.unique(ids[:, real])) > cfg.num_experts // 2  # the routing is not degenerate


def test_sampler_logprobs_match_transformers(tmp_path):
    """Left-padded prompts through `decode.prefill` and greedy `decode.decode_step`s over the KV cache (the
    rollout path, unrolled sparse layers): each step's log-softmax equals transformers' on the whole sequence."""
    model = _checkpoint("all_sparse", tmp_path)
    cfg, params = io.load_params(tmp_path)
    params = T.unstack_layers(params)
    N, prec = 4, PrecisionConfig()
    sampling = SamplingConfig(max_new_tokens=N, greedy=True)
    prompt = np.array([[0, 0, 7, 8, 9, 5], [10, 11, 12, 13, 14, 15]], np.int32)
    mask = prompt > 0
    B, P = prompt.shape
    rand = row_randomness(0, [0, 1], N)

    @jax.jit
    def rollout(p, prompt_BxP, mask_BxP):
        cache = T.init_cache(cfg, B, P + N)
        logits, cache = decode.prefill(p, prompt_BxP, mask_BxP, cache, cfg=cfg, precision=prec, max_new_tokens=N)
        c = decode.pick(logits, rand.uniforms_BxN[:, 0], rand.noise_key_data_Bx2, jnp.int32(0), precision=prec,
                        sampling=sampling)
        toks, full = [c.tok_B], [c.full_BxV]
        kv_mask = jnp.concatenate([mask_BxP, jnp.ones((B, N), bool)], axis=1)
        n_prompt = jnp.sum(mask_BxP, axis=1, dtype=jnp.int32)
        for t in range(1, N):
            c, cache = decode.decode_step(p, c.tok_B, cache, jnp.int32(P + t - 1), n_prompt + t - 1, kv_mask,
                                          rand.uniforms_BxN[:, t], rand.noise_key_data_Bx2, jnp.int32(t), cfg=cfg,
                                          precision=prec, sampling=sampling)
            toks.append(c.tok_B)
            full.append(c.full_BxV)
        return jnp.stack(toks, 1), jnp.stack(full, 1)

    toks, full = rollout(params, prompt, mask)
    seq = np.concatenate([prompt, np.asarray(toks)], axis=1)
    seq_mask = np.concatenate([mask, np.ones((B, N), bool)], axis=1)
    ref_logits, _ = _hf_run(model, seq, seq_mask, T.positions_from_mask(jnp.asarray(seq_mask)))
    ref = jax.nn.log_softmax(jnp.asarray(ref_logits[:, P - 1:P + N - 1]), axis=-1)
    delta = float(np.abs(np.asarray(full) - np.asarray(ref)).max())
    scale = float(np.abs(np.asarray(ref)).max())
    print(f"\n[moe sampler] max|Δlogprob| over {N} steps = {delta:.2e} (max|logprob| = {scale:.1f})")
    assert delta <= REL * scale
    np.testing.assert_array_equal(toks, np.argmax(np.asarray(ref), -1))  # greedy generation agrees too


def test_replayed_routing_through_the_forward_matches_transformers_with_its_router_forced(tmp_path):
    """`transformer.forward(..., replay_experts_LsxBxTxk=...)` on a mixed schedule (sparse, dense, sparse: the
    unrolled layers) against transformers with every router's choice replaced by the same forced experts (a forward
    hook) and the gate weights its own softmax at them, renormalized: the logits agree, the forward returns each
    router's own choice, and -1 keeps it."""
    model = _checkpoint("mixed", tmp_path)
    cfg, params = io.load_params(tmp_path)
    toks, mask = right_padded_batch(cfg.vocab_size)
    B, T_ = toks.shape
    E, k, Ls = cfg.num_experts, cfg.num_experts_per_tok, len(cfg.sparse_layers)
    rng = np.random.default_rng(4)
    forced = np.stack([[[rng.choice(E, k, replace=False) for _ in range(T_)] for _ in range(B)]
                       for _ in range(Ls)]).astype(np.int32)  # [Ls, B, T, k]
    forced[0, 1] = -1  # row 1 keeps the first sparse layer's own choice

    fwd = jax.jit(lambda replay: T.forward(params, jnp.asarray(toks), cfg=cfg, attn_mask_BxT=jnp.asarray(mask),
                                           return_routing=True, replay_experts_LsxBxTxk=replay))
    logits, _, own = fwd(jnp.asarray(forced))
    free_logits, _, free_own = fwd(jnp.full_like(jnp.asarray(forced), -1))
    own, free_own = np.asarray(own), np.asarray(free_own)
    np.testing.assert_array_equal(own[0, 1], free_own[0, 1])  # before any replayed layer: the same hidden states

    sparse_block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
    hooks, gates = [], [layer.mlp.gate for layer in model.model.layers if isinstance(layer.mlp, sparse_block)]
    for i, gate in enumerate(gates):
        def replace(module, inputs, out, i=i):
            ids = torch.as_tensor(np.where(forced[i] >= 0, forced[i], own[i]).reshape(B * T_, k), dtype=torch.long)
            w = torch.softmax(out[0].float(), dim=-1).gather(1, ids)
            return out[0], w / w.sum(-1, keepdim=True), ids
        hooks.append(gate.register_forward_hook(replace))
    ref, _ = _hf_run(model, toks, mask, T.positions_from_mask(jnp.asarray(mask)))
    for h in hooks:
        h.remove()
    delta = float(np.abs(np.asarray(logits) - ref)[mask].max())
    assert delta <= REL * float(np.abs(ref[mask]).max())
    assert float(np.abs(np.asarray(logits) - np.asarray(free_logits))[mask].max()) > 100 * delta  # it did replay
    chosen = (forced >= 0) & mask[None, :, :, None]
    assert np.mean(np.sort(own, -1)[chosen[..., 0]] != np.sort(forced, -1)[chosen[..., 0]]) > 0.5  # mostly not its pick


def test_export_round_trip_of_a_mixed_schedule(tmp_path):
    """save_hf -> transformers loads it as Qwen3MoeForCausalLM with the same logits; load_params gives back the
    same config and params (HF's per-expert tensor names both ways)."""
    cfg = ModelConfig(family="qwen3_moe", vocab_size=61, hidden_size=16, intermediate_size=24, num_layers=3,
                      num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True, tie_word_embeddings=False,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
                      mlp_only_layers=(1,))
    params = numpy_params(cfg, seed=5, std=0.3)
    io.save_hf(params, cfg, tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == 4
    assert type(model.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"
    toks, mask = right_padded_batch(cfg.vocab_size, seed=1)
    ours, _ = T.forward(params, jnp.asarray(toks), cfg=cfg, attn_mask_BxT=jnp.asarray(mask))
    ref, _ = _hf_run(model, toks, mask, T.positions_from_mask(jnp.asarray(mask)))
    assert float(np.abs(np.asarray(ours) - ref)[mask].max()) <= REL * float(np.abs(ref[mask]).max())
    cfg2, params2 = io.load_params(tmp_path)
    assert cfg2 == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params2, params)


def test_grouped_dispatch_and_its_gradient_equal_the_every_expert_formula():
    """`routed_swiglu` (sorted by expert, ragged_dot) against sum_e w_e SwiGLU_e(h) over all experts with zero
    weight off the chosen ones: values and gradients (inputs, gate weights, every expert's matrices)."""
    rng = np.random.default_rng(0)
    N, D, I, E, k = 7, 6, 5, 4, 2
    h, router = rng.normal(size=(N, D)), rng.normal(size=(D, E))
    w = [rng.normal(size=s) * 0.5 for s in ((E, D, I), (E, D, I), (E, I, D))]
    h, router, *w = (jnp.asarray(a, jnp.float32) for a in (h, router, *w))
    weights, ids = moe.route(h, router, k=k, norm_topk_prob=True, dtype=jnp.float32)
    probs = jax.nn.softmax(h @ router, -1)
    top = np.argsort(-np.asarray(probs), -1, kind="stable")[:, :k]
    np.testing.assert_array_equal(ids, top)
    np.testing.assert_allclose(weights, np.take_along_axis(np.asarray(probs), top, 1)
                               / np.take_along_axis(np.asarray(probs), top, 1).sum(-1, keepdims=True), rtol=1e-6)

    def grouped(h, weights, g, u, d):
        return moe.routed_swiglu(h, ids, weights, g, u, d, dtype=jnp.float32)

    def every_expert(h, weights, g, u, d):
        dense_NxE = jnp.zeros((N, E)).at[jnp.arange(N)[:, None], ids].set(weights)
        y_NxExD = jnp.einsum("nei,eid->ned", jax.nn.silu(jnp.einsum("nd,edi->nei", h, g))
                             * jnp.einsum("nd,edi->nei", h, u), d)
        return jnp.einsum("ne,ned->nd", dense_NxE, y_NxExD)

    args = (h, weights, *w)
    np.testing.assert_allclose(jax.jit(grouped)(*args), jax.jit(every_expert)(*args), rtol=1e-5, atol=1e-6)
    probe = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    g1 = jax.jit(jax.grad(lambda *a: jnp.sum(probe * grouped(*a)), argnums=range(5)))(*args)
    g2 = jax.jit(jax.grad(lambda *a: jnp.sum(probe * every_expert(*a)), argnums=range(5)))(*args)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_expert_config_reads_writes_and_refuses():
    cfg = ModelConfig(family="qwen3_moe", qk_norm=True, num_layers=4, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=16, decoder_sparse_step=2, mlp_only_layers=(3, 0, 3))
    assert cfg.mlp_only_layers == (0, 3) and cfg.sparse_layers == (1,) and not cfg.uniform_layers
    hf = cfg.to_hf_dict()
    assert (hf["model_type"], hf["num_experts"], hf["mlp_only_layers"]) == ("qwen3_moe", 8, [0, 3])
    assert ModelConfig.from_hf_dict(hf) == cfg
    alias = {k: v for k, v in hf.items() if k != "num_experts"} | {"num_local_experts": 8}  # transformers 5 writes
    assert ModelConfig.from_hf_dict(alias) == cfg
    dense = ModelConfig(family="qwen3", qk_norm=True)
    assert "num_experts" not in dense.to_hf_dict() and dense.uniform_layers and not dense.sparse_layers
    assert ModelConfig.from_hf_dict({**dense.to_hf_dict(), "num_experts": 8}) == dense  # a dense family ignores it
    with pytest.raises(ValueError, match=r"^ModelConfig.num_experts=4: model family 'qwen3' has no experts"):
        ModelConfig(family="qwen3", num_experts=4, num_experts_per_tok=1, moe_intermediate_size=8)
    with pytest.raises(ValueError, match=r"^ModelConfig.num_experts_per_tok must be in \[1, num_experts=4\], got 5$"):
        ModelConfig(family="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8)
    with pytest.raises(ValueError, match=r"^m: use_sliding_window=true is not supported$"):
        ModelConfig.from_hf_dict({**hf, "use_sliding_window": True}, source="m")


@pytest.mark.parametrize("mlp_only_layers", [(), (1,)])
def test_int8_rollout_weights_quantize_each_expert_and_keep_the_router(mlp_only_layers):
    """The rollout engine's simulated int8 weights: each expert's matrices get one scale per output channel (numpy
    reference), stacked or per-layer (a mixed schedule) alike; the router stays exact."""
    from jopd.sampling.precision import prepare_sampler_params

    cfg = ModelConfig(family="qwen3_moe", vocab_size=11, hidden_size=8, intermediate_size=6, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=4, qk_norm=True, num_experts=3, num_experts_per_tok=2,
                      moe_intermediate_size=5, mlp_only_layers=mlp_only_layers)
    params = numpy_params(cfg, seed=1, std=0.3)
    quantized = prepare_sampler_params(params, PrecisionConfig(weight_quant="int8"))
    layers = params["layers"] if mlp_only_layers else [jax.tree.map(lambda a, i=i: a[i], params["layers"])
                                                       for i in range(cfg.num_layers)]
    q_layers = quantized["layers"] if mlp_only_layers else [jax.tree.map(lambda a, i=i: a[i], quantized["layers"])
                                                            for i in range(cfg.num_layers)]
    assert sum("router" in lp for lp in layers) == len(cfg.sparse_layers) > 0
    for lp, qp in zip(layers, q_layers):
        if "router" not in lp:
            continue
        np.testing.assert_array_equal(qp["router"], lp["router"])
        for name in ("expert_gate", "expert_up", "expert_down"):
            w = np.asarray(lp[name], np.float64)  # [E, in, out]
            scale = np.abs(w).max(axis=1, keepdims=True) / 127.0
            np.testing.assert_allclose(qp[name], np.round(w / scale) * scale, rtol=1e-5, atol=1e-7)


def test_replayed_experts_run_with_the_routers_probabilities_at_them():
    """Routing replay in one sparse layer (`moe.sparse_mlp`'s `replay_BxTxk`) against a numpy hand computation: each
    token runs exactly the forced experts, weighted by the router's softmax at them renormalized over them
    (norm_topk_prob), and the router's gradient (analytic: d w_j / d l_e = w_j (1[e = j] - w_e) on the forced set)
    reaches the forced experts' columns although the router ranks them last, and not its own top-k's (which did
    not run). All -1 (no replay) is the router's own choice bit for bit."""
    rng = np.random.default_rng(3)
    N, D, I, E, k = 6, 5, 4, 4, 2
    cfg = ModelConfig(family="qwen3_moe", hidden_size=D, qk_norm=True, num_experts=E, num_experts_per_tok=k,
                      moe_intermediate_size=I, norm_topk_prob=True)
    u = rng.normal(size=D)
    u /= np.linalg.norm(u)
    h = rng.uniform(1.0, 2.0, (N, 1)) * u + 0.05 * rng.normal(size=(N, D))  # every token's top-2 is {0, 1}
    lp = {"router": np.outer(u, [3.0, 2.5, -2.5, -3.0]) + 0.1 * rng.normal(size=(D, E)),
          "expert_gate": rng.normal(size=(E, D, I)), "expert_up": rng.normal(size=(E, D, I)),
          "expert_down": rng.normal(size=(E, I, D))}
    forced = np.array([[2, 3], [3, 2]] * (N // 2))  # the two experts the router ranks last, in either order
    probe = rng.normal(size=(N, D))

    # numpy, float64
    logits = h @ lp["router"]
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    assert np.all(np.sort(np.argsort(-probs, 1)[:, :k], 1) == [0, 1])
    w = np.take_along_axis(probs, forced, 1)
    w /= w.sum(1, keepdims=True)
    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    y_Nxk = np.stack([[silu(h[n] @ lp["expert_gate"][e]) * (h[n] @ lp["expert_up"][e]) @ lp["expert_down"][e]
                       for e in forced[n]] for n in range(N)])  # [N, k, D]
    y_ref = np.einsum("nk,nkd->nd", w, y_Nxk)
    g = np.einsum("nd,nkd->nk", probe, y_Nxk)  # d L / d w
    W = np.zeros((N, E))
    np.put_along_axis(W, forced, w, 1)
    dlogits = np.zeros((N, E))
    for j in range(k):
        onehot = np.zeros((N, E))
        np.put_along_axis(onehot, forced[:, j:j + 1], 1.0, 1)
        dlogits += (g[:, j] * w[:, j])[:, None] * (onehot - W)
    grad_router_ref = h.T @ dlogits

    h32, probe32 = jnp.asarray(h[None], jnp.float32), jnp.asarray(probe[None], jnp.float32)
    lp32 = {name: jnp.asarray(a, jnp.float32) for name, a in lp.items()}

    @jax.jit
    def run(lp, replay):
        def loss(lp):
            y, own = moe.sparse_mlp(cfg, lp, h32, jnp.float32, replay)
            return jnp.sum(probe32 * y), (y, own)
        return jax.grad(loss, has_aux=True)(lp)

    grads, (y, own) = run(lp32, jnp.asarray(forced[None], jnp.int32))
    np.testing.assert_allclose(np.asarray(y)[0], y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.sort(np.asarray(own)[0], 1), np.tile([0, 1], (N, 1)))  # what it would pick
    np.testing.assert_allclose(grads["router"], grad_router_ref, rtol=1e-4, atol=1e-6)
    col = np.linalg.norm(np.asarray(grads["router"]), axis=0)
    # the forced experts' columns only (analytically 0 for the others: the renormalization cancels the softmax's
    # denominator; in fp32 a rounding residue)
    assert np.all(col[2:] > 0.1) and np.all(col[:2] < 1e-5 * col[2:].min())
    assert float(np.abs(np.asarray(grads["expert_up"])[:2]).max()) == 0.0  # the router's own picks never ran

    free = jax.jit(jax.grad(lambda lp: jnp.sum(probe32 * moe.sparse_mlp(cfg, lp, h32, jnp.float32)[0])))(lp32)
    col = np.linalg.norm(np.asarray(free["router"]), axis=0)
    assert np.all(col[:2] > 0.1) and np.all(col[2:] < 1e-5 * col[:2].min())  # without replay: the opposite columns
    grads_none, (y_none, _) = run(lp32, jnp.full((1, N, k), -1, jnp.int32))  # -1: the router's own choice
    y_free = moe.sparse_mlp(cfg, lp32, h32, jnp.float32)[0]
    np.testing.assert_array_equal(np.asarray(y_none), np.asarray(jax.jit(lambda: y_free)()))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), grads_none, free)
