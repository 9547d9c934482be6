"""A model family of your own: Llama blocks with RMSNorm on q and k before RoPE ("QK-norm"), under its own name.

A run config imports this file and then names the family like a built-in one:

    plugins: [docs/examples/my_family.py]   # in the config's folder, else the working directory
    student: {arch: {family: llama_qk_norm}}

tests/models/test_family_plugin.py trains a tiny testbed run with exactly this file.
"""

from jopd.models.families import FAMILIES, Family

FAMILIES.add("llama_qk_norm", Family(
    model_type="llama_qk_norm",  # written to config.json and read back: how jopd recognizes these checkpoints
    hf_architecture="LlamaQkNormForCausalLM",  # written to config.json; transformers has no such class
    qk_norm=True,  # the switch this family changes: q_norm/k_norm params, applied in every layer
))
