"""Chat formatting of a problem through the tokenizer's own chat template (toy or real, same code path)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def _messages(question: str, system_prompt: str | None) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": "user", "content": question}]


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of already-rendered text (the template wrote any BOS itself, so none is added here)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust encoder: thread-safe, no tokenizer state is mutated
        return list(backend.encode(text, add_special_tokens=False).ids)
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str, system_prompt: str | None = None) -> list[int]:
    """Ids of the chat-formatted prompt ending with the assistant generation marker."""
    text = tokenizer.apply_chat_template(_messages(question, system_prompt), tokenize=False,
                                         add_generation_prompt=True)
    return encode_text(tokenizer, text)


def prompt_response_ids(tokenizer: PreTrainedTokenizerBase, question: str, response: str,
                        system_prompt: str | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of a full conversation; the response ends at (and includes) the first EOS.

    The response is what the template renders after the generation prompt, so it carries the template's own
    end-of-turn marker (`<|end|>` for the toy tokenizer, `<|im_end|>` for SmolLM2); a trailing newline some
    templates add after that marker is dropped.
    """
    prompt = prompt_ids(tokenizer, question, system_prompt)
    msgs = _messages(question, system_prompt) + [{"role": "assistant", "content": response}]
    full = encode_text(tokenizer, tokenizer.apply_chat_template(msgs, tokenize=False))
    if full[: len(prompt)] != prompt:
        raise ValueError("tokenizer chat template: the rendered conversation does not start with the rendered "
                         "generation prompt, so the response tokens cannot be separated")
    response_ids = full[len(prompt):]
    eos = tokenizer.eos_token_id
    if eos is not None and eos in response_ids:
        response_ids = response_ids[: response_ids.index(eos) + 1]
    return prompt, response_ids


def user_prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str, chat_template: bool = True) -> list[int]:
    """A user's message as prompt ids: chat-formatted when the tokenizer has a template (and `chat_template`),
    else the raw text tokenized with the tokenizer's own special tokens."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return prompt_ids(tokenizer, text)
    return list(tokenizer(text)["input_ids"])
