"""The model-family registry: each entry decides the forward's switches, the config.json mapping (refused keys,
extra keys) and the GGUF layout, and every reader/writer follows the entry rather than the family's name."""

import json

import jax
import numpy as np
import pytest

from jopd.config_dataclass import ConfigError, build
from jopd.models import io
from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from jopd.models.families import FAMILIES, Family
from jopd.run.config import ArchConfig
from tests.helpers.gguf_models import write_gguf
from tests.helpers.hf_models import make_hf_model

TOY = Family(model_type="toy_fam", hf_architecture="ToyForCausalLM", qkv_bias=True, qk_norm=True,
             hf_refused={"use_window": "windows are not implemented"}, hf_extra={"use_window": False})


@pytest.fixture
def registered():
    """Register entries for one test, removed after it (a plugin's would stay for the process)."""
    names = []

    def add(name, family):
        FAMILIES.add(name, family)
        names.append(name)
        return name

    yield add
    for name in names:
        FAMILIES.remove(name)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_builtin_families_write_their_entry_and_read_back(name):
    family = FAMILIES[name]
    cfg = ModelConfig(family=name, **family.switches())
    hf = cfg.to_hf_dict()
    assert hf["architectures"] == [family.hf_architecture] and hf["model_type"] == family.model_type
    assert all(hf[k] == v for k, v in family.hf_extra.items())
    assert ModelConfig.from_hf_dict(hf) == cfg
    for key in family.hf_refused:
        with pytest.raises(ValueError, match=rf"^x/config.json: {key}=true is not supported"):
            ModelConfig.from_hf_dict({**hf, key: True}, source="x/config.json")


def test_a_registered_family_is_read_and_written_like_a_builtin(registered, tmp_path):
    name = registered("toy", TOY)
    cfg = ModelConfig(family=name, **TOY.switches())
    hf = cfg.to_hf_dict()
    assert (hf["model_type"], hf["architectures"], hf["use_window"]) == ("toy_fam", ["ToyForCausalLM"], False)
    back = ModelConfig.from_hf_dict(hf)
    assert back == cfg and back.qkv_bias and back.qk_norm
    with pytest.raises(ValueError, match=r"^m: use_window=true is not supported \(windows are not implemented\)$"):
        ModelConfig.from_hf_dict({**hf, "use_window": True}, source="m")
    # the switches shape the params, and an export carries them through config.json alone
    layers = T.param_shapes(cfg)["layers"]
    assert {"q_bias", "k_bias", "v_bias", "q_norm", "k_norm"} <= layers.keys()
    params = jax.tree.map(lambda s: np.full(s.shape, 0.5, np.float32), T.abstract_params(cfg))
    io.save_hf(params, cfg, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "toy_fam"
    loaded_cfg, loaded = io.load_params(tmp_path)
    assert loaded_cfg == cfg and loaded["layers"].keys() == params["layers"].keys()
    assert build(ArchConfig, {"family": name}).family == name


def test_unknown_and_ambiguous_names_are_one_line(registered):
    with pytest.raises(ValueError, match=r"^ModelConfig.family: unknown model family 'gpt2' \(registered: llama, "
                                         r"qwen2, qwen3"):
        ModelConfig(family="gpt2")
    with pytest.raises(ConfigError, match=r"ArchConfig.family: .*unknown model family 'gpt2' \(registered: llama"):
        build(ArchConfig, {"family": "gpt2"})
    with pytest.raises(ValueError, match=r"^c.json: model_type='gpt2' is not supported \(supported: llama, qwen2, "
                                         r"qwen3"):
        ModelConfig.from_hf_dict({"model_type": "gpt2"}, source="c.json")
    with pytest.raises(ValueError, match="already registered"):
        FAMILIES.add("llama", TOY)
    registered("llama_twin", Family(model_type="llama", hf_architecture="LlamaForCausalLM"))
    with pytest.raises(ValueError, match=r"^c.json: model_type='llama' is claimed by model families llama, "
                                         r"llama_twin \(each family needs its own model_type\)$"):
        ModelConfig.from_hf_dict(ModelConfig().to_hf_dict(), source="c.json")


def test_gguf_layout_comes_from_the_entry(registered, tmp_path):
    """The same llama.cpp-permuted tensors, read under an entry that says they are not permuted, come back
    permuted: the q/k rule is the entry's, not the name llama's."""
    model = make_hf_model("llama_tied_mha", seed=3)
    model.save_pretrained(tmp_path / "hf")
    name = registered("llama_unpermuted", Family(model_type="llama_unpermuted", hf_architecture="LlamaForCausalLM",
                                                 gguf_arch="llama_unpermuted", gguf_qk_permuted=False))
    write_gguf(tmp_path / "m.gguf", model, arch_name="llama_unpermuted")  # llama's tensors, permuted as llama's
    cfg_hf, p_hf = io.load_params(tmp_path / "hf")
    cfg_g, p_g = io.load_params(tmp_path / "m.gguf")
    assert cfg_g.family == name and cfg_hf.family == "llama"
    for leaf in ("v", "o", "gate", "attn_norm"):
        np.testing.assert_array_equal(np.asarray(p_g["layers"][leaf]), np.asarray(p_hf["layers"][leaf]))
    for leaf in ("q", "k"):
        assert not np.array_equal(np.asarray(p_g["layers"][leaf]), np.asarray(p_hf["layers"][leaf])), leaf
    with pytest.raises(ValueError, match=r"general.architecture='gemma' is not supported \(supported: llama, qwen2, "
                                         r"qwen3, llama_unpermuted\)"):
        write_gguf(tmp_path / "g.gguf", model, arch_name="gemma")
        io.open_checkpoint(tmp_path / "g.gguf")


def test_context_check_is_one_line_naming_the_model():
    cfg = ModelConfig(max_position_embeddings=64)
    cfg.check_context(64, "prompt")
    with pytest.raises(ValueError, match=r"^prompts\[0\]: 60 tokens \+ 8 exceed the model's context of 64 tokens$"):
        cfg.check_context(68, "prompts[0]: 60 tokens + 8")
    with pytest.raises(ValueError, match=r"^x = 65 exceed the teacher's context of 64 tokens$"):
        cfg.check_context(65, "x = 65", "teacher")
