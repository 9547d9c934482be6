"""The rollout engine: the KV-cache sampler and its numerics (precision, quantization, noise)."""
