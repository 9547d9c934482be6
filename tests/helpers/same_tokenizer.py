"""Two tokenizers that must behave the same (a converted GGUF tokenizer and its cached copy)."""

TEXTS = ["Hello  world!\n 123 + 45 = ?", "  leading spaces", "ünïcode ✓ 🙂 中文", "<|im_start|>user\nhi<|im_end|>",
         "Tom has 3 bags of 4 apples, buys 7. How many?\n#### 19", ""]


def assert_same_tokenizer(a, b) -> None:
    assert b.get_vocab() == a.get_vocab() and b.added_tokens_decoder == a.added_tokens_decoder
    assert b.all_special_tokens == a.all_special_tokens and b.chat_template == a.chat_template
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "padding_side"):
        assert getattr(b, name) == getattr(a, name), name
    for text in TEXTS:
        assert b.encode(text) == a.encode(text), text
        assert b.decode(a.encode(text)) == a.decode(a.encode(text)), text
    if a.chat_template is not None:
        turns = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]
        assert b.apply_chat_template(turns, tokenize=False) == a.apply_chat_template(turns, tokenize=False)
        assert (b.apply_chat_template(turns[:1], add_generation_prompt=True)
                == a.apply_chat_template(turns[:1], add_generation_prompt=True))
