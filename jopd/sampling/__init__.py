"""The rollout engine: the KV-cache sampler and its numerics (precision, quantization, noise). One job per module:
`config` (settings, output, randomness), `token_choice`, `decode` (prefill, pick, one decode step: the primitive),
`static` and `slots` (the engines), `engines` (their interface and the choice), `sampler` (the host facade)."""
