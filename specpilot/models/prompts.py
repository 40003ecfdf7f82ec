"""Prompts as token ids: plain text, or a user turn under the model's chat template."""

from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    if chat:
        if tokenizer.chat_template is None:
            raise ValueError("--chat: this model's tokenizer has no chat template")
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False))
    return tokenizer.encode(prompt)
