"""An attention implementation from outside the package: docs/examples/sdpa_attention.py (the file docs/extending.md
shows), loaded as a plugin, equals the built-in "xla" entry on every call the seam makes and through a forward."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jopd import registry
from jopd.models import transformer as T
from jopd.models.attention import ATTENTION
from tests.models.test_attention import CFG, qkv

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "sdpa_attention.py"


@pytest.fixture(scope="module")
def sdpa():
    if "sdpa" not in ATTENTION:
        registry.load_plugins([str(EXAMPLE)])
    return ATTENTION["sdpa"]


def test_causal_equals_the_xla_entry_with_padding_segments_and_gqa(sdpa):
    T_ = 8
    q, k, v = qkv(T_, T_, seed=3)
    mask = np.ones((3, T_), bool)
    mask[0, :2] = False  # left padding
    mask[1, 6:] = False  # right padding
    seg = np.array([[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 2, 2, 2]])
    for segments in (None, seg):
        ref = np.asarray(ATTENTION["xla"].causal(q, k, v, mask_BxT=mask, segment_ids_BxT=segments, dtype=jnp.float32))
        out = np.asarray(sdpa.causal(q, k, v, mask_BxT=mask, segment_ids_BxT=segments, dtype=jnp.float32))
        np.testing.assert_allclose(out[mask], ref[mask], rtol=1e-5, atol=1e-5)  # a padded query's output is unused


def test_cached_equals_the_xla_entry_at_per_row_slots(sdpa):
    S, T_ = 12, 1
    q, k, v = qkv(T_, S, seed=4)
    kv_mask = np.ones((3, S), bool)
    kv_mask[0, :3] = False
    slot = jnp.asarray([4, 8, 11])
    ref = ATTENTION["xla"].cached(q, k, v, slot=slot, kv_mask_BxS=kv_mask, dtype=jnp.float32)
    out = sdpa.cached(q, k, v, slot=slot, kv_mask_BxS=kv_mask, dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_a_forward_with_it_gives_the_same_logits(sdpa):
    params = T.init_params(CFG, jax.random.key(1))
    toks = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 7)))
    mask = jnp.asarray([[True] * 7, [False, False] + [True] * 5])
    ref, _ = T.forward(params, toks, cfg=CFG, attn_mask_BxT=mask)
    out, _ = T.forward(params, toks, cfg=CFG, attn_mask_BxT=mask, attention="sdpa")
    np.testing.assert_allclose(np.asarray(out)[np.asarray(mask)], np.asarray(ref)[np.asarray(mask)], rtol=1e-4,
                               atol=1e-5)


def test_extending_doc_shows_the_example_file_as_it_is():
    doc = (EXAMPLE.parents[1] / "extending.md").read_text()
    section = doc.split("## An attention implementation", 1)[1].split("\n## ", 1)[0]
    assert f"```python\n{EXAMPLE.read_text()}```" in section
