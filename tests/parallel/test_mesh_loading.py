"""Loading a sharded safetensors checkpoint straight into an fsdp=8 layout reads only each device's slices."""

import jax
import numpy as np
import pytest
import torch
import transformers

from jopd import parallel as M
from jopd.models import hf_io, io
from jopd.models import transformer as T
from tests.helpers import sharding as H


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """A random tiny GQA Llama (all dims divisible by 8) saved as several safetensors files + index."""
    hf_cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))  # norms too, so every tensor's values are distinct
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path, max_shard_size="100KB")
    assert (path / hf_io.INDEX_FILE).is_file() and len(list(path.glob("*.safetensors"))) > 2
    return path


def _index_key(index: tuple[slice, ...], shape) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def test_fsdp8_load_reads_only_owned_slices(sharded_checkpoint, monkeypatch):
    cfg, lazy = io.open_checkpoint(sharded_checkpoint)
    mesh = M.make_mesh(M.MeshConfig(data=1, fsdp=8))
    shardings = M.param_shardings(cfg, mesh, M.TRAIN_RULES)

    fetched_elems = []  # every read that reaches a safetensors file, in elements
    real_fetch = hf_io.SafetensorsSource.fetch
    monkeypatch.setattr(hf_io.SafetensorsSource, "fetch",
                        lambda self, name, idx: fetched_elems.append(
                            (out := real_fetch(self, name, idx)).size) or out)

    requested: dict[str, list] = {}

    def build(path, lp, sharding):
        name = jax.tree_util.keystr(path)

        def read(index):
            requested.setdefault(name, []).append(_index_key(index, lp.shape))
            return lp.read(index)

        return jax.make_array_from_callback(lp.shape, sharding, read)

    params = jax.tree_util.tree_map_with_path(build, lazy, shardings)

    full_elems = 0
    for (path, lp), sharding in zip(jax.tree_util.tree_flatten_with_path(lazy)[0], jax.tree.leaves(shardings)):
        name = jax.tree_util.keystr(path)
        owned = {_index_key(idx, lp.shape) for idx in sharding.devices_indices_map(lp.shape).values()}
        assert len(owned) == 8, f"{name}: expected 8 distinct shards under fsdp=8, got {len(owned)}"
        assert set(requested[name]) == owned, name  # one request per owned shard, nothing else
        for key in requested[name]:
            assert np.prod([b - a for a, b in key]) * 8 == np.prod(lp.shape), (name, key)  # 1/8, not whole
        full_elems += int(np.prod(lp.shape))
    # From disk: each element exactly once, and no single read larger than 1/8 of the largest param.
    assert sum(fetched_elems) == full_elems
    assert max(fetched_elems) * 8 <= max(int(np.prod(lp.shape)) for lp in jax.tree.leaves(lazy))

    _, full = io.load_params(sharded_checkpoint)  # unsharded reference load
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(full)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _, via_io = io.load_params(sharded_checkpoint, shardings=shardings)  # the library path, same layout
    for a, b, sh in zip(jax.tree.leaves(via_io), jax.tree.leaves(full), jax.tree.leaves(shardings)):
        assert a.sharding == sh
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert max(H.per_device_bytes(via_io).values()) * 8 == sum(x.nbytes for x in jax.tree.leaves(full))
    assert jax.tree.structure(params) == jax.tree.structure(T.abstract_params(cfg))
