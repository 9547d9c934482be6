"""Made-up `tokenizers`-library tokenizers for controlled cross-tokenizer cases, with the toy's chat format."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jopd.crosstok.vocab import byte_alphabet

SPECIALS = ("<pad>", "<unk>", "<eos>", "<|user|>", "<|assistant|>")
TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<eos>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def _wrap(core: Tokenizer, template: str = TEMPLATE) -> PreTrainedTokenizerFast:
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                   extra_special_tokens=list(SPECIALS[3:]), chat_template=template)


def bpe(chars: str, merges: list[tuple[str, str]], template: str = TEMPLATE) -> PreTrainedTokenizerFast:
    """A BPE over the given characters plus the merges' pieces, no pre-tokenizer, Fuse decoder."""
    pieces = [*chars, *(a + b for a, b in merges)]
    vocab = {t: i for i, t in enumerate((*SPECIALS, *pieces))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return _wrap(core, template)


def byte_bpe(merges: list[tuple[str, str]]) -> PreTrainedTokenizerFast:
    """A byte-level BPE: the 256 byte pieces of GPT-2's alphabet plus the merges (pieces in that alphabet)."""
    pieces = sorted(byte_alphabet(), key=byte_alphabet().get)
    pieces += [a + b for a, b in merges]
    vocab = {t: i for i, t in enumerate((*SPECIALS, *pieces))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    return _wrap(core)
