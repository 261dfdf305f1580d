"""Prompts: chat-template encoding of a conversation into token ids."""

from __future__ import annotations

from dynvocab.errors import DynvocabError


def encode_prompt(tokenizer, messages: list[dict] | tuple[dict, ...], chat_template: bool = True) -> list[int]:
    """Token ids of a conversation, ending with the assistant's turn opener when a chat template is used."""
    if not messages or not any(str(m.get("content", "")).strip() for m in messages):
        raise DynvocabError("the prompt is empty; pass some text")
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    text = "\n\n".join(str(m["content"]) for m in messages)
    return [int(i) for i in tokenizer(text)["input_ids"]]
