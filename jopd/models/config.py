"""Architecture config of a decoder-only transformer, and its mapping to/from HF `config.json`."""

from __future__ import annotations

import dataclasses
from typing import Any

from jopd.models.families import FAMILIES, family_of_model_type


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable (usable as a jit static argument) description of one model."""

    family: str = "llama"  # a name in `families.FAMILIES`
    vocab_size: int = 256
    hidden_size: int = 64  # D
    intermediate_size: int = 128  # F (SwiGLU width)
    num_layers: int = 2  # L
    num_heads: int = 4  # H
    num_kv_heads: int = 2  # K (GQA groups: H // K)
    head_dim: int = 16  # Dh
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # biases on q/k/v (the family's switch when read from a checkpoint)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (likewise)
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Mixture of experts (a family with `moe`; Qwen3-MoE's config.json keys). The defaults are a dense model.
    num_experts: int = 0  # E routed experts in each sparse layer; 0: every layer is dense
    num_experts_per_tok: int = 0  # k: the experts each token is routed to (top-k of the router's softmax)
    moe_intermediate_size: int = 0  # I: each expert's SwiGLU width (dense layers keep `intermediate_size`)
    norm_topk_prob: bool = False  # renormalize each token's k gate weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse iff (i + 1) % step == 0 and i is not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()  # layers kept dense whatever the step (stored sorted, without repeats)
    # Which attention implementation this model's forward runs (`jopd.models.attention`: a registered name or
    # "auto"); how the model computes, not what it is: never written to config.json.
    attention: str = "auto"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family: {FAMILIES.unknown(self.family)}")
        self._check_experts()

    def _check_experts(self) -> None:
        try:
            layers = tuple(sorted({int(i) for i in self.mlp_only_layers}))
        except (TypeError, ValueError):
            raise ValueError(f"ModelConfig.mlp_only_layers must be layer numbers, got {self.mlp_only_layers!r}") from None
        if any(i < 0 for i in layers):
            raise ValueError(f"ModelConfig.mlp_only_layers must be non-negative, got {list(self.mlp_only_layers)}")
        object.__setattr__(self, "mlp_only_layers", layers)  # a list from config.json: hashable, one spelling
        if self.num_experts < 0:
            raise ValueError(f"ModelConfig.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts == 0:
            return
        if not FAMILIES[self.family].moe:
            raise ValueError(f"ModelConfig.num_experts={self.num_experts}: model family {self.family!r} has no "
                             f"experts (one with moe=True, e.g. qwen3_moe, has)")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"ModelConfig.num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"ModelConfig.moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"ModelConfig.decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` runs the routed experts (HF Qwen3-MoE's rule) rather than the dense MLP."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_sparse(i))

    @property
    def uniform_layers(self) -> bool:
        """Every layer of one kind (all dense or all sparse): the layers stack on a leading L axis (`lax.scan`)."""
        return len(self.sparse_layers) in (0, self.num_layers)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def check_context(self, tokens: int, what: str, model: str = "model") -> None:
        """One line if a sequence of `tokens` (described by `what`, e.g. "prompts[3]: 60 tokens +
        max_new_tokens=8") does not fit the context of `model` (how the error names it)."""
        if tokens > self.max_position_embeddings:
            raise ValueError(f"{what} exceed the {model}'s context of {self.max_position_embeddings} tokens")

    # ---- HF config.json ----
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        name = family_of_model_type(hf.get("model_type"), source)
        family = FAMILIES[name]
        if hf.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act={hf.get('hidden_act')!r} is not supported (only 'silu')")
        for key, why in family.hf_refused.items():
            if hf.get(key):
                raise ValueError(f"{source}: {key}=true is not supported" + (f" ({why})" if why else ""))
        rope_scaling = None
        rs = hf.get("rope_scaling") or {}
        rope_params = hf.get("rope_parameters") or {}
        rope_type = rs.get("rope_type", rs.get("type")) or rope_params.get("rope_type")
        src = rs or rope_params
        if rope_type == "llama3":
            rope_scaling = RopeScaling(
                factor=float(src["factor"]), low_freq_factor=float(src["low_freq_factor"]),
                high_freq_factor=float(src["high_freq_factor"]),
                original_max_position_embeddings=int(src["original_max_position_embeddings"]))
        elif rope_type not in (None, "default"):
            raise ValueError(f"{source}: rope_scaling type {rope_type!r} is not supported (default, llama3)")
        theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // heads
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = tuple(eos)
        experts = _experts_from_hf(hf) if family.moe else {}
        return cls(
            family=name,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),  # transformers' default for all three
            **family.switches(),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=hf.get("pad_token_id"),
            **experts,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        family = FAMILIES[self.family]
        out: dict[str, Any] = {
            "architectures": [family.hf_architecture],
            "model_type": family.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if family.moe:
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers))
        out.update(family.hf_extra)
        for k in ("bos_token_id", "pad_token_id"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.eos_token_id is not None:
            out["eos_token_id"] = (list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                                   else self.eos_token_id)
        return out


def _experts_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The expert fields of a MoE family's config.json. transformers 5 writes `num_experts` as `num_local_experts`
    (an attribute alias); released checkpoints spell it `num_experts`. The optional keys take transformers'
    defaults, so jopd builds the model transformers builds."""
    num = hf["num_experts"] if "num_experts" in hf else hf.get("num_local_experts")
    if num is None:
        raise KeyError("num_experts")
    return dict(num_experts=int(num or 0), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))
