"""Token byte strings against the tokenizers' own decoding."""

from jopd.crosstok.vocab import byte_alphabet, vocab_of
from jopd.data.toy_tokenizer import CHARACTERS, special_token_ids


def test_byte_alphabet_is_a_bijection_onto_bytes():
    alpha = byte_alphabet()
    assert sorted(alpha.values()) == list(range(256)) and alpha["Ġ"] == 32 and alpha["Ċ"] == 10 and alpha["a"] == 97


def test_smollm2_token_bytes_decode_like_the_tokenizer(smollm2):
    v = vocab_of(smollm2)
    assert v.byte_level and len(v) == 49152 and v.eos_id == smollm2.eos_token_id
    special = set(special_token_ids(smollm2))
    assert {i for i, b in enumerate(v.token_bytes) if b is None} == special
    text_ids = [i for i in range(len(v)) if i not in special]
    decoded = smollm2.backend_tokenizer.decode_batch([[i] for i in text_ids])
    # the tokenizer's decode is lossy on partial UTF-8 (U+FFFD), exactly as Python's errors="replace"
    assert [v.token_bytes[i].decode("utf-8", errors="replace") for i in text_ids] == decoded
    partial = [i for i in text_ids if "\ufffd" in decoded[i - text_ids[0]]]
    assert len(partial) > 100  # pieces of multi-byte characters exist, and keep their exact bytes
    # a sequence's bytes are its tokens' bytes concatenated
    ids = smollm2.backend_tokenizer.encode("héllo 😀 中文 ok", add_special_tokens=False).ids
    assert b"".join(v.token_bytes[i] for i in ids) == "héllo 😀 中文 ok".encode()


def test_toy_token_bytes(toy):
    v = vocab_of(toy)
    assert not v.byte_level and len(v) == 103
    assert [b.decode() for b in v.token_bytes if b is not None] == list(CHARACTERS)
