"""jopd: on-policy distillation of language models in JAX."""

import os as _os

# jopd uses transformers for tokenizers only, never its (PyTorch) models, so transformers' import-time advisory
# "PyTorch was not found. Models won't be available ..." is noise on a base install. Only `logger.warning_advice`
# calls honour this variable (read at call time); warnings and errors still print. Set it to "" to see advisories.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"
