"""Checkpoint reading details: lazy slices, sharded loading, tiny GGUF files (llama.cpp permutation undone),
bf16 compute tolerance, and one clear error per kind of bad input."""

import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jopd import cli
from jopd.models import io
from jopd.models import transformer as T
from jopd.models.hf_io import SafetensorsSource
from tests.helpers.bf16_tolerance import bf16_rel_rms_tolerance, rel_rms
from tests.helpers.gguf_models import write_gguf
from tests.helpers.hf_models import make_hf_model, right_padded_batch


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2")
    make_hf_model("qwen2_untied", seed=5).save_pretrained(d)
    return d


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


# ---------------------------------------------------------------------------------------------
# lazy reads and sharded loading


def test_lazy_read_of_any_box_equals_slice_of_full_read(qwen2_dir):
    cfg, lazy = io.open_checkpoint(qwen2_dir)
    assert jax.tree.structure(lazy) == jax.tree.structure(T.abstract_params(cfg))
    rng = np.random.default_rng(0)
    abstract = jax.tree.leaves(T.abstract_params(cfg))
    for (path, lp), ab in zip(jax.tree.flatten_with_path(lazy)[0], abstract):
        assert lp.shape == ab.shape
        full = lp.read_all()
        assert full.shape == lp.shape and full.dtype == lp.dtype == np.float32
        for _ in range(3):
            box = []
            for n in lp.shape:
                a, b = sorted(rng.integers(0, n + 1, 2))
                box.append(slice(a, max(b, a + 1) if a < n else b))
            box = tuple(box)
            np.testing.assert_array_equal(lp.read(box), full[box], err_msg=jax.tree_util.keystr(path))


def test_lazy_read_fetches_only_the_requested_heads(qwen2_dir, monkeypatch):
    cfg, lazy = io.open_checkpoint(qwen2_dir)
    requested = []
    orig = SafetensorsSource.fetch
    monkeypatch.setattr(SafetensorsSource, "fetch",
                        lambda self, name, idx: requested.append((name, idx)) or orig(self, name, idx))
    Dh = cfg.head_dim
    lazy["layers"]["q"].read((slice(1, 2), slice(None), slice(1, 3), slice(None)))
    assert requested == [("model.layers.1.self_attn.q_proj.weight", (slice(Dh, 3 * Dh), slice(0, cfg.hidden_size)))]
    requested.clear()
    lazy["layers"]["down"].read((slice(0, 2), slice(8, 16), slice(0, 4)))  # down [L,F,D] <- HF [D,F]
    assert [r[1] for r in requested] == [(slice(0, 4), slice(8, 16))] * 2


def test_sharded_load_equals_plain_load(qwen2_dir):
    cfg, plain = io.load_params(qwen2_dir)
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    rules = {"embed": "fsdp", "vocab": None, "heads": None, "kv_heads": None, "mlp": "data"}
    shardings = jax.tree.map(lambda axes: NamedSharding(mesh, P(*[rules.get(a) for a in axes])),
                             T.param_logical_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    _, sharded = io.load_params(qwen2_dir, shardings=shardings)
    assert sharded["layers"]["gate"].sharding.spec == P(None, "fsdp", "data")
    assert len(sharded["layers"]["gate"].addressable_shards[0].data.reshape(-1)) * 8 == sharded["layers"]["gate"].size
    _assert_trees_equal(sharded, plain)
    _, bf16 = io.load_params(qwen2_dir, dtype=jnp.bfloat16, shardings=shardings)
    assert bf16["embed"].dtype == jnp.bfloat16
    _assert_trees_equal(bf16, jax.tree.map(lambda a: a.astype(jnp.bfloat16), plain))


# ---------------------------------------------------------------------------------------------
# tiny GGUF files


@pytest.mark.parametrize("case", ["llama_untied_llama3", "qwen2_tied_mqa", "qwen3_untied_hd24"])
def test_tiny_gguf_gives_the_same_params_as_the_hf_dir(case, tmp_path):
    model = make_hf_model(case, seed=7)
    if case.startswith("llama"):  # GGUF carries no llama3 rope scaling metadata (llama.cpp uses rope_freqs)
        theta = model.config.rope_parameters["rope_theta"]
        model.config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    model.save_pretrained(tmp_path / "hf")
    write_gguf(tmp_path / "m.gguf", model)
    cfg_hf, p_hf = io.load_params(tmp_path / "hf")
    cfg_g, p_g = io.load_params(tmp_path / "m.gguf")
    for field in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings", "qkv_bias", "qk_norm",
                  "rope_scaling", "max_position_embeddings"):
        assert getattr(cfg_g, field) == getattr(cfg_hf, field), field
    assert cfg_g.rms_norm_eps == pytest.approx(cfg_hf.rms_norm_eps, rel=1e-6)  # stored as float32 in GGUF
    _assert_trees_equal(p_g, p_hf)  # q/k permutation undone exactly


# ---------------------------------------------------------------------------------------------
# bf16 compute


@pytest.mark.parametrize("case", ["llama_untied_llama3", "qwen2_tied_mqa", "qwen3_untied_hd24"])
def test_bf16_compute_within_tolerance(case, tmp_path):
    make_hf_model(case).save_pretrained(tmp_path)
    cfg, params = io.load_params(tmp_path)
    toks, mask = right_padded_batch(cfg.vocab_size)
    kw = dict(cfg=cfg, attn_mask_BxT=jnp.asarray(mask))
    f32, _ = T.forward(params, jnp.asarray(toks), **kw)
    b16, _ = T.forward(params, jnp.asarray(toks), dtype=jnp.bfloat16, **kw)
    err = rel_rms(np.asarray(b16)[mask], np.asarray(f32)[mask])
    print(f"\n[bf16] {case}: rel. RMS Δlogit = {err:.4f} (tolerance {bf16_rel_rms_tolerance(cfg.num_layers):.4f})")
    assert 2.0 ** -12 < err <= bf16_rel_rms_tolerance(cfg.num_layers)  # lower bound: bf16 really was used


# ---------------------------------------------------------------------------------------------
# bad input: one clear error naming the file and the field


def _raises(exc, path, *needles):
    with pytest.raises(exc) as e:
        io.open_checkpoint(path)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert str(n) in msg, (n, msg)
    return msg


def test_missing_path(tmp_path):
    _raises(FileNotFoundError, tmp_path / "nope", tmp_path / "nope")
    _raises(FileNotFoundError, tmp_path, tmp_path / "config.json")


def test_missing_weights_file(qwen2_dir, tmp_path):
    (tmp_path / "config.json").write_text((qwen2_dir / "config.json").read_text())
    _raises(FileNotFoundError, tmp_path, tmp_path, "model.safetensors", "model.safetensors.index.json")


def test_unsupported_model_type(qwen2_dir, tmp_path):
    hf = json.loads((qwen2_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "model_type": "gpt2"}))
    _raises(ValueError, tmp_path, tmp_path / "config.json", "model_type='gpt2'")


def test_unsupported_attention_bias(qwen2_dir, tmp_path):
    hf = json.loads((qwen2_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "model_type": "llama", "attention_bias": True}))
    _raises(ValueError, tmp_path, tmp_path / "config.json", "attention_bias")


def test_shape_mismatch(tmp_path):
    make_hf_model("llama_tied_mha").save_pretrained(tmp_path)  # D=32, 4 heads x 8
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "intermediate_size": 64}))
    msg = _raises(ValueError, tmp_path)
    assert msg == (f"{tmp_path / 'model.safetensors'}: model.layers.0.mlp.down_proj.weight has shape (32, 48), "
                   f"{tmp_path / 'config.json'} implies (32, 64)")


def test_missing_tensor(tmp_path):
    make_hf_model("llama_tied_mha").save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(f))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors.numpy.save_file(tensors, str(f), metadata={"format": "pt"})
    _raises(ValueError, tmp_path, f, "missing tensor model.layers.1.mlp.up_proj.weight", "config.json")


def test_index_lists_a_missing_shard(tmp_path):
    make_hf_model("llama_tied_mha").save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    _raises(FileNotFoundError, tmp_path, "model.safetensors.index.json", shard.name)


def test_gguf_unsupported_quant_type(tmp_path):
    path = tmp_path / "q.gguf"
    write_gguf(path, make_hf_model("qwen2_tied_mqa"), raw_types={"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q8_1})
    _raises(ValueError, path, path, "blk.0.attn_q.weight", "Q8_1")


def test_gguf_missing_tensor_and_architecture(tmp_path):
    model = make_hf_model("qwen3_tied")
    path = tmp_path / "m.gguf"
    write_gguf(path, model, drop=("blk.1.attn_k_norm.weight",))
    _raises(ValueError, path, path, "missing tensor blk.1.attn_k_norm.weight")
    write_gguf(path, model, arch_name="gemma")
    _raises(ValueError, path, path, "general.architecture='gemma'")


def test_cli_prints_one_line_error(tmp_path, capsys):
    assert cli.main(["generate", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(tmp_path / "nope") in err
