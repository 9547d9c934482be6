"""One side's chat format around a response: the rendered generation prompt and the end-of-turn marker.

For a conversation `messages` (the turns before the assistant's) and a response text R, a tokenizer's chat
template renders

    render(messages + [assistant: R]) = render(messages, add_generation_prompt=True) + R + suffix

where the suffix is the template's end of the assistant turn (`<|im_end|>\\n` for SmolLM2, `<|end|>` for the toy
tokenizer). The **end-of-turn ids** are the ids of the suffix up to and including the first EOS token (a
trailing newline after it is dropped, as `data.chat.prompt_response_ids` drops it): the tokens a model emits to
end its turn. A template that does not render R verbatim (one that trims or rewrites the content) or whose
suffix carries no EOS cannot be aligned, and says so.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from transformers import PreTrainedTokenizerBase

from jopd.data.chat import encode_text

Messages = Sequence[Mapping[str, str]]


class TemplateError(ValueError):
    """A chat template that cannot frame a response for alignment (one line)."""


def generation_prompt(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> str:
    """The rendered conversation ending with the assistant's generation marker."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("tokenizer has no chat template")
    with_marker = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    without = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=False)
    if with_marker == without:
        raise TemplateError("chat template has no generation marker (add_generation_prompt renders nothing)")
    return with_marker


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase, messages: Messages, response: str) -> list[int]:
    """The template's end-of-turn ids after `response` (see the module docstring)."""
    prompt = generation_prompt(tokenizer, messages)
    full = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=False)
    if not full.startswith(prompt + response):
        raise TemplateError("chat template does not render the response verbatim after the generation prompt")
    ids = encode_text(tokenizer, full[len(prompt) + len(response):])
    eos = tokenizer.eos_token_id
    if eos is None or eos not in ids:
        raise TemplateError("chat template writes no EOS token after the assistant's response")
    return ids[: ids.index(eos) + 1]
