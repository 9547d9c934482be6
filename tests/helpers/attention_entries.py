"""A "chunked" attention entry with blocks of 8 for the tests: the sampler's caches (tens of slots) then span
several key tiles, so tile skipping (a tile past every row's slot, decided over the whole batch) is exercised;
the registered "chunked" (blocks of 512) would see one tile. Registered once, on import."""

import functools

from jopd.models.attention import ATTENTION, Attention
from jopd.models.attention_chunked import chunked_cached, chunked_causal

CHUNKED_SMALL = "chunked_blocks_8"

if CHUNKED_SMALL not in ATTENTION:
    ATTENTION.add(CHUNKED_SMALL, Attention(causal=functools.partial(chunked_causal, block_q=8, block_k=8),
                                           cached=functools.partial(chunked_cached, block_q=8, block_k=8)))
