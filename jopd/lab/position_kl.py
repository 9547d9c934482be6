"""Rollout/trainer **mismatch** at the positions a rollout visited (docs/architecture.md, "Definitions"): the
exact full-vocabulary KL(sampler's next-token distribution q ‖ trainer's p) at the same temperature, from a
rollout and the trainer's forward. The KL itself (`exact_kl_BxT`) and the cheap estimators from the sampled
tokens alone (`mismatch_estimators`) are `jopd.losses.is_correction`'s, which the train step logs too.

Pure functions over arrays (jit-able); the caller supplies the masks of real response tokens.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jopd.losses.chunked import chunked_logits_map
from jopd.losses.is_correction import exact_kl_BxT
from jopd.models import transformer
from jopd.models.moe import expert_set_flips
from jopd.models.config import ModelConfig
from jopd.opd.batch import sequence_layout
from jopd.sampling.config import SampleOutput


def trainer_response_logits(logits_fn: Callable[[np.ndarray, np.ndarray], jax.Array],
                            prompts: Sequence[Sequence[int]], tokens_BxN: Int[Array, "B N"]) -> Float[Array, "B N V"]:
    """The trainer's logits for each response position of the sampler's output: prompt + response (right-padded,
    all N response slots kept) through `logits_fn(tokens_BxT, mask_BxT) -> logits_BxTxV`; row b's response slot t
    is predicted at position len(prompt_b) - 1 + t."""
    tokens_BxN = np.asarray(tokens_BxN)
    n = tokens_BxN.shape[1]
    width = max(map(len, prompts)) + n
    toks = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        toks[i, :len(p) + n], mask[i, :len(p) + n] = list(p) + tokens_BxN[i].tolist(), True
    logits = logits_fn(toks, mask)
    return jnp.stack([logits[i, len(p) - 1:len(p) - 1 + n] for i, p in enumerate(prompts)])


def position_mismatch(params, prompt_BxP: Int[Array, "B P"], prompt_mask_BxP: Bool[Array, "B P"], sample: SampleOutput,
                      *, model_cfg: ModelConfig, temperature: float, chunk: int = 128, dtype=jnp.float32,
                      routing_replay: bool = False
                      ) -> dict[str, jax.Array]:
    """Per response position, the trainer's view of a rollout: exact KL(sampler ‖ trainer) over the full
    vocabulary (`exact_kl_BxT`; needs the sampler's full log-softmax, `SamplingConfig.return_full_logprobs`)
    and the trainer's log-prob of the sampled token, from the trainer's forward over prompt + response
    (projected chunk by chunk). `dtype`: the trainer's compute dtype (`OPDStep.compute_dtype`): the forward and
    the head run as in the update, so the trainer side is the distribution the update differentiates.
    Returns {"exact_kl_BxN", "trainer_logprobs_BxN", "response_mask_BxN"}.

    A sample with the sampler's routing (a mixture-of-experts student, `SampleOutput.expert_ids_BxSxLsxk`) adds,
    per sequence position, "router_flips_BxS" (the sparse layers whose expert set differs from the trainer's own
    choice, `moe.expert_set_flips`) and "routed_BxS" (the positions the sampler recorded); with `routing_replay`
    the trainer's forward runs the sampler's experts (`train.routing_replay`: the forward the update
    differentiates), so the KL is measured against it."""
    if sample.full_logprobs_BxNxV is None:
        raise ValueError("position_mismatch: the sample has no full log-softmax (sample with return_full_logprobs)")
    recorded = sample.expert_ids_BxSxLsxk
    if routing_replay and recorded is None:
        raise ValueError("position_mismatch: routing_replay needs the sampler's routing (a mixture-of-experts student)")
    layout = sequence_layout(prompt_BxP, prompt_mask_BxP, sample.tokens_BxN, sample.lengths_B)
    N, S = layout.targets_BxN.shape[1], layout.tokens_BxS.shape[1]
    recorded = None if recorded is None else jnp.moveaxis(recorded, 2, 0)  # [Ls, B, S, k]: the forward's layout
    hidden, _, *own = transformer.forward(params, layout.tokens_BxS, cfg=model_cfg, attn_mask_BxT=layout.attn_mask_BxS,
                                          dtype=dtype, return_hidden=True, return_routing=recorded is not None,
                                          replay_experts_LsxBxTxk=recorded if routing_replay else None)
    hidden = jax.lax.stop_gradient(hidden[:, S - N - 1:S - 1])  # the positions that predict the response

    def per_chunk(logits_BxCxV, inp):
        log_p = jax.nn.log_softmax(logits_BxCxV / temperature, axis=-1)
        target = jnp.take_along_axis(log_p, inp["targets"][..., None], axis=-1)[..., 0]
        return {"exact_kl_BxN": exact_kl_BxT(inp["log_q"], logits_BxCxV, temperature),
                "trainer_logprobs_BxN": target}

    out = chunked_logits_map(per_chunk, params, hidden, {"log_q": sample.full_logprobs_BxNxV,
                                                         "targets": layout.targets_BxN}, chunk, remat=False,
                             dtype=dtype)
    out |= {"response_mask_BxN": layout.response_mask_BxN}
    if recorded is not None:
        flips_BxS, routed_BxS = expert_set_flips(own[0], recorded)
        out |= {"router_flips_BxS": flips_BxS, "routed_BxS": routed_BxS}
    return out
