"""Corpus readers shared by the builders and the runtime (the ShareGPT train/eval split lives here)."""

from dynvocab.data.sharegpt import (
    conversation_text,
    is_eval_position,
    iter_json_array,
    sharegpt_eval,
    sharegpt_records,
    sharegpt_train,
    to_messages,
)

__all__ = [
    "conversation_text",
    "is_eval_position",
    "iter_json_array",
    "sharegpt_eval",
    "sharegpt_records",
    "sharegpt_train",
    "to_messages",
]
