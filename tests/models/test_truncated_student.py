"""A student made of a checkpoint's first N layers (`ModelSource.num_layers`), and built-in model names."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jopd.run.config import load_config
from jopd.models import io
from jopd.models import transformer as T
from jopd.run.model_sources import precheck_sources
from tests.helpers.hf_models import make_hf_model, right_padded_batch


@pytest.fixture(scope="module")
def three_layer_llama(tmp_path_factory):
    model = make_hf_model("llama_untied_llama3")
    model.config.num_hidden_layers = 3
    model = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("llama3l")
    model.save_pretrained(path)
    return path


def test_first_layers_match_transformers_truncated_model(three_layer_llama):
    cfg, params = io.load_params(three_layer_llama, num_layers=1)
    assert cfg.num_layers == 1 and params["layers"]["attn_norm"].shape[0] == 1
    # transformers' own truncation: the same checkpoint loaded with one layer (the others are left unread)
    ref = transformers.AutoModelForCausalLM.from_pretrained(three_layer_llama, num_hidden_layers=1,
                                                            dtype=torch.float32).eval()
    tokens, mask = right_padded_batch(cfg.vocab_size)
    with torch.no_grad():
        want = ref(input_ids=torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask)).logits.numpy()
    got = np.asarray(T.forward(params, jnp.asarray(tokens), cfg=cfg, attn_mask_BxT=jnp.asarray(mask.astype(bool)))[0])
    m = mask.astype(bool)
    assert np.abs(got[m] - want[m]).max() <= 1e-4
    full_cfg, full = io.load_params(three_layer_llama)
    assert full_cfg.num_layers == 3
    np.testing.assert_array_equal(np.asarray(full["layers"]["attn_norm"][:1]), np.asarray(params["layers"]["attn_norm"]))


def test_too_many_layers_names_the_checkpoint(three_layer_llama):
    with pytest.raises(ValueError, match=r"llama3l\d*: num_layers=4, but the checkpoint has 3 layers"):
        io.open_checkpoint(three_layer_llama, num_layers=4)


def test_precheck_names_the_field(three_layer_llama, tmp_path):
    cfg = load_config(None, [f"teacher.path={three_layer_llama}", f"student.path={three_layer_llama}",
                             "student.num_layers=5"])
    with pytest.raises(ValueError, match=r"RunConfig\.student: .*num_layers=5, but the checkpoint has 3 layers"):
        precheck_sources(cfg)
    cfg = load_config(None, ["student.num_layers=1"])
    with pytest.raises(ValueError, match=r"RunConfig\.student\.num_layers: only applies to a checkpoint"):
        precheck_sources(cfg)


def test_builtin_name_resolves_to_the_packaged_smollm2():
    assert io.resolve_model_path("smollm2-135m-instruct") == io.smollm2_gguf_path()
    cfg, lazy = io.open_checkpoint("smollm2-135m-instruct", num_layers=4)  # metadata only
    assert (cfg.num_layers, cfg.vocab_size) == (4, 49152)
    assert lazy["layers"]["attn_norm"].shape == (4, cfg.hidden_size)
