"""Aligning a student's sampled response with the teacher's tokenization of the same text.

Definitions (every offset is in **bytes of the response's UTF-8**, half-open, because a byte-level BPE token may
cover part of a multi-byte character; `Alignment.spans_chars_Kx2` gives character offsets where they exist):

- **response text** R: the concatenation of the bytes of the student's response tokens (`vocab.Vocab`), which
  must be valid UTF-8. The student's ids are used as sampled, so a non-canonical tokenization is fine.
- **student tokens**: text tokens, then optionally the student's EOS (`tokenizer.eos_token_id`, the token the
  sampler stops at) as the last token. Any other special token in the response, or anything after the EOS, is a
  failure. Student text token i covers `student_offsets_Nsx2[i]`; the EOS covers the empty range (L, L),
  L = len(R in bytes).
- **teacher tokens**: the teacher's rendered generation prompt (its own chat template, `template.py`) gives the
  prompt ids; the response text R is tokenized **on its own** (no BOS, no special tokens added) and appended,
  exactly as a sampler appends response tokens to prompt ids, so no teacher token straddles the prompt and the
  response; when the student's response ends with its EOS, the teacher's end-of-turn ids follow (the template's
  suffix through its EOS, `template.end_of_turn_ids`), each covering (L, L). The teacher's text tokens must be
  text (no `<unk>`, no special token parsed out of R) and their bytes must reproduce R exactly.
- **aligned spans**: the boundaries of a side are its text tokens' end offsets plus 0; the common boundaries
  0 = b_0 < b_1 < ... < b_m = L cut R into text spans [b_k, b_{k+1}), each covered exactly by a contiguous run of
  student tokens and a contiguous run of teacher tokens (the finest such partition). When the student's
  response ends with its EOS, one more **end span** follows: student EOS <-> the teacher's end-of-turn ids, bytes
  (L, L): "the turn ends here" on both sides, never matched to text. Special and template tokens are in no
  other span.

`check_pair` catches before training what makes a pair unalignable on every rollout (a character the student
can emit that the teacher cannot encode, a template without a generation marker, a decoder that does not
concatenate); `align_response` returns a `Misaligned` reason for a rollout that still fails (invalid UTF-8, a
special-token string inside the text, ...): a row is never silently dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from jaxtyping import Int
from transformers import PreTrainedTokenizerBase

from jopd.crosstok.template import Messages, TemplateError, end_of_turn_ids, generation_prompt
from jopd.crosstok.vocab import Vocab, vocab_of
from jopd.data.chat import encode_text

PROBE_MESSAGES = ({"role": "user", "content": "What is 12 + 34?"},)
PROBE_TEXT = "Hello, world! 12 + 34 = 46.\n  Two  spaces; (brackets) [and] {braces} 'quotes' \"x\" #### 46"


class PairError(ValueError):
    """A student/teacher tokenizer pair that cannot be aligned (one line)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Pair:
    """A checked student/teacher pair (`check_pair`)."""

    student_tok: PreTrainedTokenizerBase
    teacher_tok: PreTrainedTokenizerBase
    student: Vocab
    teacher: Vocab
    teacher_end_ids: tuple[int, ...]  # the teacher's end-of-turn ids after a probe response


@dataclasses.dataclass(frozen=True)
class Misaligned:
    """A rollout that cannot be aligned, and why (one line)."""

    reason: str


@dataclasses.dataclass(frozen=True, eq=False)
class Alignment:
    """One rollout aligned (module docstring). Spans are indexed k = 0..K-1, token ranges half-open; when
    `ends_turn`, span K-1 is the end span."""

    text: str
    student_ids_Ns: Int[np.ndarray, "Ns"]
    student_offsets_Nsx2: Int[np.ndarray, "Ns 2"]
    teacher_prompt_ids_Pt: Int[np.ndarray, "Pt"]
    teacher_ids_Nt: Int[np.ndarray, "Nt"]  # the teacher's response: text ids, then end-of-turn ids if ends_turn
    teacher_offsets_Ntx2: Int[np.ndarray, "Nt 2"]
    n_teacher_text: int
    spans_student_Kx2: Int[np.ndarray, "K 2"]
    spans_teacher_Kx2: Int[np.ndarray, "K 2"]
    spans_bytes_Kx2: Int[np.ndarray, "K 2"]
    spans_chars_Kx2: Int[np.ndarray, "K 2"]  # character offsets into `text`; -1 where a boundary splits a character
    ends_turn: bool

    @property
    def n_spans(self) -> int:
        return len(self.spans_bytes_Kx2)


def _offsets(lengths_N: np.ndarray) -> np.ndarray:
    ends = np.cumsum(lengths_N, dtype=np.int64)
    return np.stack([ends - lengths_N, ends], axis=-1).astype(np.int32).reshape(-1, 2)


def common_spans(student_lengths_Ns: Int[np.ndarray, "Ns"], teacher_lengths_Nt: Int[np.ndarray, "Nt"]
                 ) -> tuple[Int[np.ndarray, "K 2"], Int[np.ndarray, "K 2"], Int[np.ndarray, "K 2"]]:
    """The aligned text spans of two tokenizations of the same bytes, from their tokens' byte lengths (all > 0,
    equal totals): (student token ranges, teacher token ranges, byte ranges), each [K, 2] half-open."""
    s_len, t_len = np.asarray(student_lengths_Ns, np.int64), np.asarray(teacher_lengths_Nt, np.int64)
    if (s_len <= 0).any() or (t_len <= 0).any() or s_len.sum() != t_len.sum():
        raise ValueError(f"common_spans: token lengths must be positive with equal totals, got totals "
                         f"{s_len.sum()} and {t_len.sum()}")
    s_ends, t_ends = np.cumsum(s_len), np.cumsum(t_len)
    cuts = np.intersect1d(s_ends, t_ends)
    starts = np.concatenate([[0], cuts[:-1]]).astype(np.int64)
    s_idx = np.searchsorted(s_ends, np.concatenate([[0], cuts]), side="right")
    t_idx = np.searchsorted(t_ends, np.concatenate([[0], cuts]), side="right")
    pairs = lambda idx: np.stack([idx[:-1], idx[1:]], axis=-1).astype(np.int32).reshape(-1, 2)  # noqa: E731
    return pairs(s_idx), pairs(t_idx), np.stack([starts, cuts], axis=-1).astype(np.int32).reshape(-1, 2)


def _char_index_of_byte(text: str) -> np.ndarray:
    """[L + 1]: the character index at each byte offset of text's UTF-8, -1 inside a character."""
    out = np.full(len(text.encode("utf-8")) + 1, -1, np.int32)
    pos = 0
    for i, ch in enumerate(text):
        out[pos] = i
        pos += len(ch.encode("utf-8"))
    out[pos] = len(text)
    return out


def _char_name(ch: str) -> str:
    return f"{ch!r} (U+{ord(ch):04X})"


def _teacher_text(pair: Pair, text: str) -> tuple[list[int], str | None]:
    """The teacher's ids of `text` alone, or a failure reason."""
    enc = pair.teacher_tok.backend_tokenizer.encode(text, add_special_tokens=False)
    ids = list(enc.ids)
    for j, i in enumerate(ids):
        if not pair.teacher.is_text(i):
            a, b = enc.offsets[j]
            if i == pair.teacher.unk_id:
                return ids, f"teacher maps {_char_name(text[a]) if b > a else 'text'} at character {a} to <unk>"
            return ids, f"response text contains the teacher's special token {text[a:b]!r} at character {a}"
    if b"".join(pair.teacher.token_bytes[i] for i in ids) != text.encode("utf-8"):
        return ids, "teacher's token strings do not reproduce the response text (its normalizer changes the text)"
    return ids, None


def align_response(pair: Pair, messages: Messages, student_ids: Sequence[int]) -> Alignment | Misaligned:
    """Align one student response (its ids as sampled, without padding) with the teacher's tokenization of the
    same conversation (`messages`: the turns before the assistant's). Returns the alignment or why it fails."""
    sv = pair.student
    ids = [int(i) for i in student_ids]
    ends_turn = bool(ids) and ids[-1] == sv.eos_id
    text_ids = ids[:-1] if ends_turn else ids
    for pos, i in enumerate(text_ids):
        if not 0 <= i < len(sv):
            return Misaligned(f"student token {pos} is id {i}, outside its tokenizer's {len(sv)} ids")
        if sv.token_bytes[i] is None:
            name = pair.student_tok.convert_ids_to_tokens(i)
            what = "EOS before the end" if i == sv.eos_id else f"special token {name!r}"
            return Misaligned(f"student token {pos} is the {what} (only a final EOS may be special)")
    raw = b"".join(sv.token_bytes[i] for i in text_ids)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Misaligned(f"student response is not valid UTF-8 ({e.reason} at byte {e.start} of {len(raw)})")
    try:
        prompt_ids = encode_text(pair.teacher_tok, generation_prompt(pair.teacher_tok, messages))
        end_ids = end_of_turn_ids(pair.teacher_tok, messages, text) if ends_turn else []
    except TemplateError as e:
        return Misaligned(f"teacher {e}")
    t_text, why = _teacher_text(pair, text)
    if why is not None:
        return Misaligned(why)
    L = len(raw)
    s_len = np.array([len(sv.token_bytes[i]) for i in text_ids], np.int64)
    t_len = np.array([len(pair.teacher.token_bytes[i]) for i in t_text], np.int64)
    if L:
        spans_s, spans_t, spans_b = common_spans(s_len, t_len)
    else:
        spans_s = spans_t = spans_b = np.zeros((0, 2), np.int32)
    if ends_turn:
        spans_s = np.concatenate([spans_s, [[len(text_ids), len(ids)]]]).astype(np.int32)
        spans_t = np.concatenate([spans_t, [[len(t_text), len(t_text) + len(end_ids)]]]).astype(np.int32)
        spans_b = np.concatenate([spans_b, [[L, L]]]).astype(np.int32)
    tail = lambda n: np.full((n, 2), L, np.int32)  # noqa: E731
    return Alignment(
        text=text,
        student_ids_Ns=np.array(ids, np.int32),
        student_offsets_Nsx2=np.concatenate([_offsets(s_len), tail(len(ids) - len(text_ids))]),
        teacher_prompt_ids_Pt=np.array(prompt_ids, np.int32),
        teacher_ids_Nt=np.array(t_text + end_ids, np.int32),
        teacher_offsets_Ntx2=np.concatenate([_offsets(t_len), tail(len(end_ids))]),
        n_teacher_text=len(t_text),
        spans_student_Kx2=spans_s, spans_teacher_Kx2=spans_t, spans_bytes_Kx2=spans_b,
        spans_chars_Kx2=_char_index_of_byte(text)[spans_b],
        ends_turn=ends_turn,
    )


def _side_checks(tok: PreTrainedTokenizerBase, vocab: Vocab, side: str) -> tuple[int, ...]:
    """One side's template and decoder checks; returns its end-of-turn ids after a probe response."""
    if vocab.eos_id is None:
        raise PairError(f"{side} tokenizer has no EOS token")
    try:
        end = end_of_turn_ids(tok, PROBE_MESSAGES, "46")
    except TemplateError as e:
        raise PairError(f"{side} {e}") from None
    ids = encode_text(tok, PROBE_TEXT)
    if not all(vocab.is_text(i) for i in ids) or b"".join(vocab.token_bytes[i] for i in ids) != PROBE_TEXT.encode():
        raise PairError(f"{side} tokenizer's token strings do not concatenate to an ASCII probe text (decoder "
                        f"{type(tok.backend_tokenizer.decoder).__name__} is not supported)")
    return tuple(end)


def _student_characters(student: Vocab) -> list[str]:
    chars = set()
    for b in student.token_bytes:
        if b is not None:
            chars.update(b.decode("utf-8", errors="ignore"))
    return sorted(chars)


def check_pair(student_tok: PreTrainedTokenizerBase, teacher_tok: PreTrainedTokenizerBase) -> Pair:
    """Raise a one-line `PairError` if the pair cannot be aligned whatever the student samples: a template without
    a generation marker or without an EOS after the response, a decoder whose token strings do not concatenate,
    or a character occurring in a student token that the teacher cannot encode as text (maps to `<unk>`, or
    encodes to other bytes); a byte-level student (which can emit any character) needs a byte-level teacher."""
    try:
        student, teacher = vocab_of(student_tok, "student"), vocab_of(teacher_tok, "teacher")
    except ValueError as e:
        raise PairError(str(e)) from None
    _side_checks(student_tok, student, "student")
    end = _side_checks(teacher_tok, teacher, "teacher")
    chars = _student_characters(student)
    encodings = teacher_tok.backend_tokenizer.encode_batch(chars, add_special_tokens=False)
    for ch, enc in zip(chars, encodings):
        ok = all(teacher.is_text(i) for i in enc.ids)
        if not ok or b"".join(teacher.token_bytes[i] for i in enc.ids) != ch.encode("utf-8"):
            how = "to <unk>" if teacher.unk_id in enc.ids else "not as itself"
            raise PairError(f"teacher encodes {_char_name(ch)}, a character the student can emit, {how}")
    if student.byte_level and not teacher.byte_level:
        raise PairError("student is byte-level (it can emit any character) but the teacher is not")
    return Pair(student_tok=student_tok, teacher_tok=teacher_tok, student=student, teacher=teacher,
                teacher_end_ids=end)
