"""A request's prompt as the engine will see it, in token ids: the model's own tokenizer and
chat template (`fleetllm.tokenizer`, the engine's code), with the engine's defaults for
`add_special_tokens` and `add_generation_prompt`.

Only what the router can reproduce exactly is tokenized: a chat request's text messages
(with `chat_template_kwargs`), or a single prompt (text or token ids). A request the engine
reads otherwise (tools, continuing the final message, several prompts, a suffix, truncation)
gives None, and the router routes it without knowing what is cached. A request whose prompt
logprobs are wanted is computed from scratch by the engine: it gives no tokens to look up.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fleetllm.tokenizer import Tokenizer

_UNREPRODUCED = ("tools", "continue_final_message", "documents", "chat_template", "suffix")
_TRUNCATION = ("truncate_prompt_tokens",)


class PromptTokenizer:
    """One model's tokenizer, loaded from its model directory (tokenizer.json and its
    companions, as the engine loads them)."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        """Prompts longer than this are cut here: only their beginning keys the lookup."""

    @classmethod
    def load(cls, directory: Path, max_tokens: int) -> PromptTokenizer:
        return cls(Tokenizer.from_pretrained(directory), max_tokens)

    def tokens(self, payload: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids, or None where the router cannot know them."""
        if any(payload.get(key) not in (None, False) for key in _UNREPRODUCED + _TRUNCATION):
            return None
        if payload.get("prompt_logprobs") is not None or (
            payload.get("echo") and payload.get("logprobs") is not None
        ):
            return []
        messages = payload.get("messages")
        if messages is not None:
            return self._chat(payload, messages)
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            special = payload.get("add_special_tokens", True)
            return self._encode(prompt, special is not False)
        if isinstance(prompt, list) and prompt and all(_token_id(t) for t in prompt):
            return prompt[: self.max_tokens]
        return None

    def _chat(self, payload: Mapping[str, Any], messages: Any) -> list[int] | None:
        kwargs = payload.get("chat_template_kwargs") or {}
        generation = payload.get("add_generation_prompt", True)
        if not isinstance(kwargs, dict) or not isinstance(generation, bool):
            return None
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation, **kwargs
            )
        except (ValueError, TypeError):
            return None  # the engine answers 400; the router need not know where to send it
        return self._encode(text, payload.get("add_special_tokens", False) is True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # Tokens are about four characters: a prompt is cut in text first, with a margin,
        # so that a huge one costs what its beginning costs.
        cut = text[: self.max_tokens * 16]
        return self.tokenizer.encode(cut, add_special_tokens=add_special_tokens)[: self.max_tokens]


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32
