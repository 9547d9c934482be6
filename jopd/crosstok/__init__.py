"""Cross-tokenizer on-policy distillation: a teacher with another tokenizer scores the student's response.

- `vocab`: each token id's exact bytes (byte-level BPE pieces decoded through GPT-2's byte alphabet).
- `template`: a side's rendered generation prompt and end-of-turn ids.
- `align`: `check_pair` (before training, one-line `PairError`), `align_response` (one rollout: the teacher's
  prompt and response ids, byte offsets of both sides, aligned spans; or a `Misaligned` reason).
- `spans`: the exact sampled-path signal per span, log p_student(span) - log p_teacher(span) (JAX).
- `project`: the teacher's next-token distribution projected onto the student's support at a span start, backed
  off to the start of the teacher's last token (JAX), for the truncated reverse KL with a tail.

Pure functions; the OPD step uses them through `jopd.opd.cross_teacher` (docs/cross_tokenizer.md).
"""

from jopd.crosstok.align import Alignment, Misaligned, Pair, PairError, align_response, check_pair, common_spans
from jopd.crosstok.project import (Extensions, Projected, ProjectionTable, back_off, placeholder_table,
                                    project_extensions, project_teacher, projection_table)
from jopd.crosstok.spans import SpanIndex, SpanLogProbs, at_tokens, span_index, span_logprobs
from jopd.crosstok.vocab import Vocab, vocab_of

__all__ = ["Alignment", "Misaligned", "Pair", "PairError", "align_response", "check_pair", "common_spans",
           "Extensions", "Projected", "ProjectionTable", "back_off", "placeholder_table", "project_extensions",
           "project_teacher", "projection_table", "SpanIndex", "SpanLogProbs",
           "at_tokens", "span_index", "span_logprobs", "Vocab", "vocab_of"]
