"""The decode primitive (`jopd.sampling.decode`) against the plain forward, the engines' interface
(`jopd.sampling.engines`), and the sampling modules' layering (no circle; no engine imports the facade)."""

import ast
import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from jopd.sampling import decode
from jopd.sampling.config import SamplingConfig, row_randomness
from jopd.sampling.engines import ENGINES, choose_engine, engine_of
from jopd.sampling.precision import PrecisionConfig
from jopd.sampling.sampler import Sampler
from tests.helpers.tiny_params import numpy_params

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, max_position_embeddings=96, tie_word_embeddings=False, eos_token_id=3)
N = 6
SAMPLING = SamplingConfig(max_new_tokens=N, temperature=0.7, return_full_logprobs=True, return_topk=3)
PRECISION = PrecisionConfig()


@functools.lru_cache(maxsize=None)
def params():
    return T.unstack_layers(numpy_params(CFG, 3, layer_scale=5.0, head_scale=6.0))


@functools.partial(jax.jit, static_argnames="per_row")
def _prefill_then_step(p, prompt_BxP, mask_BxP, u_BxN, noise_Bx2, per_row):
    B, P = prompt_BxP.shape
    cache = T.init_cache(CFG, B, P + N)
    logits, cache = decode.prefill(p, prompt_BxP, mask_BxP, cache, cfg=CFG, precision=PRECISION, max_new_tokens=N)
    first = decode.pick(logits, u_BxN[:, 0], noise_Bx2, jnp.int32(0), precision=PRECISION, sampling=SAMPLING)
    n_prompt = jnp.sum(mask_BxP, axis=1, dtype=jnp.int32)
    kv_mask = jnp.concatenate([mask_BxP, jnp.ones((B, N), bool)], axis=1)
    slot = jnp.full((B,), P, jnp.int32) if per_row else jnp.int32(P)
    t = jnp.ones((B,), jnp.int32) if per_row else jnp.int32(1)
    second, _ = decode.decode_step(p, first.tok_B, cache, slot, n_prompt, kv_mask, u_BxN[:, 1], noise_Bx2, t,
                                   cfg=CFG, precision=PRECISION, sampling=SAMPLING)
    return logits, first, second


@pytest.mark.parametrize("per_row", [False, True])
def test_prefill_and_a_decode_step_match_the_full_forward(per_row):
    """prefill's logits are the full forward's at each prompt's last position; a decode step (one slot index, or
    one per row) chooses from the full forward's logits of the prompt + the first token, at the temperature."""
    prompt = np.array([[0, 0, 7, 8, 9], [10, 11, 12, 13, 14]], np.int32)
    mask = prompt > 0
    rand = row_randomness(4, [0, 1], N)
    logits, first, second = _prefill_then_step(params(), prompt, mask, rand.uniforms_BxN, rand.noise_key_data_Bx2,
                                               per_row=per_row)
    full, _ = T.forward(params(), jnp.asarray(prompt), cfg=CFG, attn_mask_BxT=mask)
    np.testing.assert_allclose(logits, full[:, -1], rtol=1e-5, atol=1e-5)
    ext = np.concatenate([prompt, np.asarray(first.tok_B)[:, None]], axis=1)
    full2, _ = T.forward(params(), jnp.asarray(ext), cfg=CFG, attn_mask_BxT=np.concatenate([mask, [[True]] * 2], 1))
    want = jax.nn.log_softmax(full2[:, -1] / SAMPLING.temperature, axis=-1)
    np.testing.assert_allclose(second.full_BxV, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(second.ulogp_B, np.take_along_axis(np.asarray(want), np.asarray(second.tok_B)[:, None],
                                                                  1)[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(second.topk_BxK, jax.lax.top_k(want, 3)[1])


def test_pick_is_the_same_for_a_scalar_step_and_per_row_steps():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, CFG.vocab_size)) * 3, jnp.float32)
    rand = row_randomness(1, range(4), N)
    noisy = PrecisionConfig(logit_noise=0.5)
    kw = dict(precision=noisy, sampling=SamplingConfig(max_new_tokens=N, top_p=0.9, top_k=20))
    a = decode.pick(logits, rand.uniforms_BxN[:, 2], rand.noise_key_data_Bx2, jnp.int32(2), **kw)
    b = decode.pick(logits, rand.uniforms_BxN[:, 2], rand.noise_key_data_Bx2, jnp.full((4,), 2, jnp.int32), **kw)
    for x, y in zip(a, b):
        if x is not None:
            np.testing.assert_array_equal(x, y)


def test_engine_choice_and_decode_steps():
    """One rule picks the engine; each engine's `decode_steps` is the decode passes its program reports."""
    assert choose_engine(32, 1, SamplingConfig()) == (0, 32) and engine_of(0) is ENGINES["static"]
    assert choose_engine(32, 4, SamplingConfig()) == (4, 32) and engine_of(4) is ENGINES["slots"]
    assert choose_engine(7, 1, SamplingConfig(slots=5), shards=2) == (1, 4)
    assert not ENGINES["static"].per_row and ENGINES["slots"].per_row
    stop = SamplingConfig(max_new_tokens=12, top_p=0.9, stop_token_ids=(4, 5, 6, 7, 8))
    rows = [[9, 10, 11], [12], [13, 14, 15, 16], [19, 20, 21, 22, 23]]  # a batch bucket: no filler rows
    for slots in (0, 2):
        sampler = Sampler(CFG, dataclasses.replace(stop, slots=slots))
        out = sampler.generate(params(), rows, seed=3)
        assert len(set(out.lengths_B.tolist())) > 2
        choice = sampler.engine(len(rows))
        assert choice.engine.decode_steps(out.lengths_B, choice.slots, 1) == out.decode_iterations
    assert ENGINES["static"].decode_steps(np.full(5, 12), 5, 1) == 11  # every row to max_new_tokens


def _sampling_imports():
    """{module: the jopd.sampling modules it imports at module level or in a function}."""
    root = Path(__file__).resolve().parents[2] / "jopd" / "sampling"
    graph = {}
    for path in root.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                names |= {m.split(".")[2] for m in mods if m.startswith("jopd.sampling.")}
            elif isinstance(node, ast.Import):
                names |= {a.name.split(".")[2] for a in node.names if a.name.startswith("jopd.sampling.")}
        graph[path.stem] = names - {path.stem}
    return graph


def test_sampling_modules_import_no_circle_and_engines_not_the_facade():
    graph = _sampling_imports()
    assert all("sampler" not in graph[m] for m in ("config", "token_choice", "decode", "static", "slots", "engines"))
    seen, done = set(), set()

    def visit(m, path):
        assert m not in seen or m in done, f"import circle: {' -> '.join(path + [m])}"
        if m in done:
            return
        seen.add(m)
        for n in graph.get(m, ()):
            visit(n, path + [m])
        done.add(m)

    for m in graph:
        visit(m, [])
