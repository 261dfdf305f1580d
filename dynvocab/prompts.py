"""Prompts as the models see them: a conversation encoded into token ids, and the code instruction.

Everything that turns a conversation into a target's prompt reads this module, so a generation, a bench row and a
self-distilled training prompt open the same way: the API and ``generate``, the bench's rows and tasks, the
``python-stubs`` corpus and ``train-draft --self-distill``. It sits low (beside ``data/``, importing only
:mod:`dynvocab.errors`) because builders and the runtime both need it and never import each other; it takes a
tokenizer as it comes and loads nothing.
"""

from __future__ import annotations

from dynvocab.errors import DynvocabError

# The instruction a code prompt is wrapped in: the bench's ``code`` task (HumanEval) and the ``python-stubs`` corpus.
CODE_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n```python\n{prompt}```"


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
