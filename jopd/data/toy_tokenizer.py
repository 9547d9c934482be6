"""A tiny character-level tokenizer for the CPU testbed, served through the same transformers API as real ones.

One token per printable ASCII character (plus newline); anything else maps to `<unk>`. Chat turns are framed by
marker tokens as SmolLM2 frames them with `<|im_start|>`/`<|im_end|>`: the end-of-turn marker `<|end|>` is also
the EOS token, so "stop at `tokenizer.eos_token_id`" works for the toy and the real tokenizer alike.

    <bos><|user|>Ann has 7 pens, gets 5. How many?<|end|><|assistant|>7+5=12. #### 12<|end|>
"""

from __future__ import annotations

import string

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, UNK, BOS, END = "<pad>", "<unk>", "<bos>", "<|end|>"
ROLE_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, UNK, BOS, END, *ROLE_MARKERS)
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"

# Jinja chat template (the format transformers' apply_chat_template renders).
TOY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def toy_vocab() -> dict[str, int]:
    """Token -> id; special tokens first (pad = 0), then characters in a fixed order."""
    return {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}


def build_toy_tokenizer() -> PreTrainedTokenizerFast:
    """The deterministic toy tokenizer (103 tokens), with chat template, left padding for prompts."""
    core = Tokenizer(models.WordLevel(toy_vocab(), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char alone
    core.decoder = decoders.Fuse()  # join characters back without separators
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens=list(ROLE_MARKERS),
        chat_template=TOY_CHAT_TEMPLATE,
        padding_side="left",
    )


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Sorted ids of every special and chat-template marker token of any HF tokenizer (toy or real).

    Union of the declared special tokens (bos/eos/pad/unk/extra) and every added token flagged special
    (e.g. SmolLM2's `<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, `<repo_name>`, ...). Losses mask positions
    whose target is one of these.
    """
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return sorted(i for i in ids if i is not None and i >= 0)
