"""Model families: one `Family` entry per architecture, holding everything that differs between them.

The forward (`transformer.py`) is one implementation switched by `ModelConfig.qkv_bias` / `qk_norm`; a family
fixes those switches and says how checkpoints name it (HF `config.json`, GGUF metadata). A family with `moe` reads
and writes the Qwen-MoE expert keys of config.json (the `ModelConfig` expert fields; sparse layers then run
`moe.sparse_mlp`). A new family is one
`FAMILIES.add(name, Family(...))` in any module, a run config's `plugins` included (docs/extending.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jopd.registry import Registry, registered

SWITCHES = ("qkv_bias", "qk_norm")  # the `ModelConfig` fields (forward switches) a family fixes


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture: the forward's switches, and how HF and GGUF checkpoints name and lay it out."""

    # config.json `model_type`: how a checkpoint's family is recognized, so no two families may share one
    model_type: str
    hf_architecture: str  # config.json `architectures[0]` on export (the transformers class that loads it)
    qkv_bias: bool = False  # biases on the q/k/v projections
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE
    # config.json keys the family's HF class reads that jopd cannot run when true: key -> why (may be "")
    hf_refused: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # written into an exported config.json, so transformers builds exactly this model whatever its defaults
    hf_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    gguf_arch: str | None = None  # GGUF `general.architecture` (also its metadata key prefix); None: no GGUF
    # llama.cpp's converter permutes q/k rows for this arch (its RoPE pairs adjacent dims, HF's the two halves)
    gguf_qk_permuted: bool = False
    # config.json holds an expert schedule (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
    # decoder_sparse_step, mlp_only_layers; HF's per-expert tensor names): the ModelConfig expert fields may be set
    moe: bool = False

    def switches(self) -> dict[str, bool]:
        """The `ModelConfig` fields this family fixes, e.g. {"qkv_bias": True, "qk_norm": False}."""
        return {name: getattr(self, name) for name in SWITCHES}


FAMILIES: Registry[Family] = Registry("model family")
FamilyName = registered(FAMILIES)  # a config field naming a family (checked when the config is built)

_O_PROJ_BIAS = "it adds an o_proj bias"
FAMILIES.add("llama", Family(
    model_type="llama", hf_architecture="LlamaForCausalLM", hf_refused={"attention_bias": _O_PROJ_BIAS},
    hf_extra={"attention_bias": False, "mlp_bias": False}, gguf_arch="llama", gguf_qk_permuted=True))
FAMILIES.add("qwen2", Family(  # Qwen2's q/k/v biases are fixed by the class (it ignores attention_bias)
    model_type="qwen2", hf_architecture="Qwen2ForCausalLM", qkv_bias=True, hf_refused={"use_sliding_window": ""},
    hf_extra={"use_sliding_window": False}, gguf_arch="qwen2"))
FAMILIES.add("qwen3", Family(
    model_type="qwen3", hf_architecture="Qwen3ForCausalLM", qk_norm=True,
    hf_refused={"attention_bias": _O_PROJ_BIAS}, gguf_arch="qwen3"))
FAMILIES.add("qwen3_moe", Family(  # Qwen3 attention; sparse layers: softmax router, top-k of num_experts SwiGLUs
    model_type="qwen3_moe", hf_architecture="Qwen3MoeForCausalLM", qk_norm=True, moe=True,
    hf_refused={"attention_bias": _O_PROJ_BIAS, "use_sliding_window": ""}))


def _claimed_by(field: str, value: Any, key: str, source: str) -> str:
    names = [n for n, f in FAMILIES.items() if getattr(f, field) is not None and getattr(f, field) == value]
    if not names:
        known = dict.fromkeys(getattr(f, field) for _, f in FAMILIES.items() if getattr(f, field) is not None)
        raise ValueError(f"{source}: {key}={value!r} is not supported (supported: {', '.join(known)})")
    if len(names) > 1:
        raise ValueError(f"{source}: {key}={value!r} is claimed by model families {', '.join(names)} (each "
                         f"family needs its own {field})")
    return names[0]


def family_of_model_type(model_type: Any, source: str = "config.json") -> str:
    """The name of the family whose `model_type` this is (one line naming `source` if none or several)."""
    return _claimed_by("model_type", model_type, "model_type", source)


def family_of_gguf_arch(arch: Any, source: str) -> str:
    """The name of the family stored under GGUF `general.architecture` = `arch`."""
    return _claimed_by("gguf_arch", arch, "general.architecture", source)
