"""The text each token id stands for, as UTF-8 bytes: what cross-tokenizer alignment and projection compare.

`vocab_of(tokenizer)` gives, for every id of an HF fast tokenizer, the exact bytes it contributes to the decoded
text, or None for a token that is not text (a special or chat-template marker token: EOS, end-of-turn, role
markers, `<unk>`, padding; exactly `data.toy_tokenizer.special_token_ids`).

Two decoders are supported, detected from the backend tokenizer's serialized decoder:

- byte-level BPE (GPT-2 style; SmolLM2, Qwen, Llama-3): a vocabulary piece is a string over GPT-2's 256-char
  byte alphabet (`Ġ` = the space byte, `Ċ` = newline, ...); its bytes are the alphabet's inverse image. A piece
  may be part of a multi-byte UTF-8 character (SmolLM2's `ĠðŁĺ` = space + 3 of the 4 bytes of an emoji), so
  token strings are bytes, not str, everywhere in this package.
- any other decoder whose decoding of a sequence is the concatenation of its tokens' decodings (e.g. `Fuse`, the
  toy tokenizer's): a token's bytes are the UTF-8 of `decode([id])`. Whether a tokenizer really concatenates is
  checked by `align.check_pair` on a probe text (SentencePiece-style `Metaspace` decoders, which drop a leading
  space, fail it), and at run time every alignment checks that the teacher's token bytes reproduce the text.
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from jopd.data.toy_tokenizer import special_token_ids


@dataclasses.dataclass(frozen=True, eq=False)
class Vocab:
    """One tokenizer's token strings. `token_bytes[i]`: the UTF-8 bytes id i decodes to (never empty), or None when
    id i is not text (special / template marker, or an id the tokenizer does not define)."""

    name: str
    token_bytes: tuple[bytes | None, ...]
    eos_id: int | None
    unk_id: int | None
    byte_level: bool

    def __len__(self) -> int:
        return len(self.token_bytes)

    def is_text(self, i: int) -> bool:
        return 0 <= i < len(self.token_bytes) and self.token_bytes[i] is not None

    def token_name(self, i: int) -> str:
        """A readable name for messages: the token's text (repr) or its special string."""
        b = self.token_bytes[i] if 0 <= i < len(self.token_bytes) else None
        return repr(b.decode("utf-8", errors="backslashreplace")) if b is not None else f"special id {i}"


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: the printable bytes 33..126, 161..172 and 174..255 stand for
    themselves; the other 68 bytes, in increasing order, are chr(256), chr(257), ..."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _decoder_type(tokenizer: PreTrainedTokenizerBase) -> str | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__}: not a fast tokenizer (cross-tokenizer alignment needs the "
                         f"Rust backend's vocabulary)")
    decoder = json.loads(backend.to_str()).get("decoder")
    return None if decoder is None else decoder.get("type")


def vocab_of(tokenizer: PreTrainedTokenizerBase, name: str | None = None) -> Vocab:
    """Every id's bytes (see the module docstring); ids 0 .. len(tokenizer) - 1."""
    backend = tokenizer.backend_tokenizer
    byte_level = _decoder_type(tokenizer) == "ByteLevel"
    special = set(special_token_ids(tokenizer))
    added = {i for i in tokenizer.added_tokens_decoder}
    alphabet = byte_alphabet()
    out: list[bytes | None] = []
    for i in range(len(tokenizer)):
        piece = backend.id_to_token(i)
        if piece is None or i in special:
            out.append(None)
        elif byte_level and i not in added:
            try:
                out.append(bytes(alphabet[c] for c in piece))
            except KeyError:
                raise ValueError(f"{name or type(tokenizer).__name__}: token {i} {piece!r} is not a byte-level "
                                 f"BPE piece") from None
        else:
            out.append(backend.decode([i], skip_special_tokens=False).encode("utf-8") or None)
    return Vocab(name=name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__,
                 token_bytes=tuple(out), eos_id=tokenizer.eos_token_id, unk_id=tokenizer.unk_token_id,
                 byte_level=byte_level)
