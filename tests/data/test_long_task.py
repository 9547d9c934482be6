"""The long-horizon testbed task (configs/testbed_long.yaml): responses of ~60-120 tokens, and raising the
`max_steps` bound left the existing configs' held-out problems as they were."""

import hashlib

import numpy as np

from jopd.data.arithmetic import ArithmeticConfig, heldout_problems
from jopd.run.config import load_config


def test_testbed_heldout_split_is_unchanged():
    ps = heldout_problems(ArithmeticConfig(max_steps=2, max_number=10))  # configs/testbed.yaml's task
    digest = hashlib.sha256("".join(p.question + p.solution for p in ps).encode()).hexdigest()[:16]
    assert digest == "1a450d7821473172"  # computed with the code before the bound was raised (max_steps <= 6)


def test_long_task_responses_are_60_to_120_tokens():
    cfg = load_config("configs/testbed_long.yaml")
    ps = heldout_problems(cfg.data.arithmetic)
    lengths = np.array([len(p.solution) for p in ps])  # character-level tokenizer: one token per character
    assert 55 <= np.percentile(lengths, 5) and np.percentile(lengths, 95) <= 120
    assert lengths.max() + 1 <= cfg.sampling.max_new_tokens <= cfg.data.max_response_len  # + the end token
    assert max(len(p.question) for p in ps) + 10 <= cfg.data.max_prompt_len
