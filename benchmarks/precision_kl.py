"""Rollout/trainer mismatch by precision policy on SmolLM2-135M-Instruct (fp32 trainer).

For each rollout precision (and optional logit / weight noise) the sampler generates responses to a few chat
prompts with the full unprocessed log-softmax returned; the fp32 trainer forward scores the same sequences;
the table shows the exact KL(sampler ‖ trainer) per response token (mean and max over tokens) and the cheap
estimators k1, k3 and the IS-weight ESS from the sampled tokens (docs/architecture.md, "Definitions").

    PYTHONPATH=. python benchmarks/precision_kl.py [--new-tokens 32] [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from jopd.runtime.xla_flags import apply_cpu_defaults  # noqa: E402

apply_cpu_defaults()  # jopd's XLA:CPU defaults, as the CLI runs with

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jopd.data.chat import user_prompt_ids  # noqa: E402
from jopd.lab.position_kl import trainer_response_logits  # noqa: E402
from jopd.losses.is_correction import exact_kl_BxT, mismatch_estimators  # noqa: E402
from jopd.models import io  # noqa: E402
from jopd.models import transformer as T  # noqa: E402
from jopd.sampling.config import SamplingConfig  # noqa: E402
from jopd.sampling.precision import precision_from_name, prepare_sampler_params  # noqa: E402
from jopd.sampling.sampler import Sampler  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
           "List three prime numbers.", "How do I reverse a list in Python?", "Tell me a fun fact about cats.",
           "What is 17 times 23?", "Give me a synonym for happy."]
SETUPS = [("fp32", 0.0, 0.0), ("fp16", 0.0, 0.0), ("bf16", 0.0, 0.0), ("int8", 0.0, 0.0), ("fp8", 0.0, 0.0),
          ("fp32", 0.1, 0.0), ("fp32", 0.0, 0.01)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    path = io.smollm2_gguf_path()
    cfg, params = io.load_params(path)
    tok = io.load_tokenizer(path)
    prompts = [user_prompt_ids(tok, p) for p in PROMPTS]
    n = args.new_tokens
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=n, return_full_logprobs=True)
    trainer = jax.jit(lambda p, t, m: T.forward(p, t, cfg=cfg, attn_mask_BxT=m)[0])
    print(f"SmolLM2-135M-Instruct, {len(prompts)} chat prompts x up to {n} sampled tokens, temperature "
          f"{args.temperature}; exact KL(sampler || fp32 trainer) in nats/token")
    print(f"{'precision':>9} {'logit σ':>7} {'weight σ':>8} | {'mean KL':>9} {'max KL':>9} | {'k1':>10} {'k3':>9} "
          f"{'ESS':>6}")
    for name, logit_sigma, weight_sigma in SETUPS:
        precision = precision_from_name(name, logit_noise=logit_sigma, weight_noise=weight_sigma)
        rollout = prepare_sampler_params(params, precision, jax.random.key(0))
        out = Sampler(cfg, sampling, precision).generate(rollout, prompts, seed=0)
        trainer_BxNxV = trainer_response_logits(lambda t, m: trainer(params, t, m), prompts, out.tokens_BxN)
        m = out.response_mask_BxN
        kl = np.asarray(exact_kl_BxT(out.full_logprobs_BxNxV, trainer_BxNxV, args.temperature))[m]
        trainer_logp = jax.nn.log_softmax(trainer_BxNxV / args.temperature, axis=-1)
        trainer_tok = np.take_along_axis(np.asarray(trainer_logp), out.tokens_BxN[..., None], axis=-1)[..., 0]
        est = mismatch_estimators(out.unprocessed_logprobs_BxN, trainer_tok, m)
        print(f"{name:>9} {logit_sigma:>7} {weight_sigma:>8} | {kl.mean():>9.2e} {kl.max():>9.2e} | "
              f"{float(est['k1']):>10.2e} {float(est['k3']):>9.2e} {float(est['ess']):>6.3f}", flush=True)


if __name__ == "__main__":
    main()
