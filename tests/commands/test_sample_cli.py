"""`jopd sample` end to end on a tiny exported HF model with a tiny word-level tokenizer."""

import json

import jax
import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from jopd import cli
from jopd.models import io
from jopd.models import transformer as T
from jopd.models.config import ModelConfig
from tests.helpers.tiny_params import numpy_params

WORDS = ["<unk>", "<s>", "</s>", "user", "assistant", "one", "two", "three", "four", "five", "six", "seven"]
CFG = ModelConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=40, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", pad_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                          "{% if add_generation_prompt %}<s> assistant {% endif %}")
    path = tmp_path_factory.mktemp("tiny_model")
    io.save_hf(numpy_params(CFG, 3, layer_scale=5.0, head_scale=10.0), CFG, path, tokenizer=fast)
    return path


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def sample(model_dir, prompts_file, out, *extra):
    return cli.main(["sample", "--model", str(model_dir), "--prompts", str(prompts_file), "--out", str(out),
                     "--max-new-tokens", "6", "--batch-size", "2", *extra])


def test_sample_writes_completions_with_the_models_logprobs(model_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", ["one two", "three", "four five six"])
    assert sample(model_dir, prompts, tmp_path / "a.jsonl", "--seed", "4") == 0
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["one two", "three", "four five six"]
    tok = io.load_tokenizer(model_dir)
    seqs = []
    for r in rows:
        n = len(r["tokens"])
        assert 1 <= n <= 6 and len(r["logprobs"]) == n
        assert (r["finish_reason"] == "stop") == (r["tokens"][-1] == 2) and 2 not in r["tokens"][:-1]
        assert r["completion"] == tok.decode(r["tokens"], skip_special_tokens=True)
        ids = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        assert ids[:3] == [1, 3, WORDS.index(r["prompt"].split()[0])]  # the chat template was applied
        seqs.append((ids, r["tokens"]))
    # fp32, temperature 1, no truncation: the written logprobs are the model's own log-softmax
    width = max(len(a) + len(b) for a, b in seqs)
    toks = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros((len(seqs), width), bool)
    for i, (a, b) in enumerate(seqs):
        toks[i, :len(a) + len(b)], mask[i, :len(a) + len(b)] = a + b, True
    logp = jax.nn.log_softmax(T.forward(io.load_params(model_dir)[1], toks, cfg=CFG, attn_mask_BxT=mask)[0], -1)
    for i, ((a, b), r) in enumerate(zip(seqs, rows)):
        ref = logp[i, np.arange(len(a) - 1, len(a) - 1 + len(b)), b]
        np.testing.assert_allclose(r["logprobs"], ref, atol=1e-5, rtol=0)

    # same seed -> same file; the sampler's batch size does not change the samples
    assert sample(model_dir, prompts, tmp_path / "b.jsonl", "--seed", "4", "--batch-size", "3") == 0
    assert (tmp_path / "b.jsonl").read_text() == (tmp_path / "a.jsonl").read_text()
    assert sample(model_dir, prompts, tmp_path / "c.jsonl", "--seed", "5") == 0
    assert (tmp_path / "c.jsonl").read_text() != (tmp_path / "a.jsonl").read_text()


def test_sample_bad_input_names_the_field(model_dir, tmp_path, capsys):
    good = write_prompts(tmp_path / "good.jsonl", ["one"])
    (tmp_path / "empty.jsonl").write_text("\n")
    cases = [
        ((tmp_path / "empty.jsonl",), "empty.jsonl: no prompts"),
        ((tmp_path / "missing.jsonl",), "missing.jsonl: no such prompts file"),
        ((write_prompts(tmp_path / "long.jsonl", ["one", "two " * 40]),), "long.jsonl:2: prompt of"),
        ((good, "--top-p", "1.5"), "--top-p: Input should be less than or equal to 1"),
        ((good, "--top-p", "0"), "--top-p: Input should be greater than 0"),
        ((good, "--precision", "fp4"), "--precision: unknown precision 'fp4'"),
        ((good, "--logit-noise", "-1"), "--logit-noise: Input should be greater than or equal to 0"),
    ]
    for (prompts, *extra), message in cases:
        assert sample(model_dir, prompts, tmp_path / "o.jsonl", *extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (message, err)
