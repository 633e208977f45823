"""A request's prompt as the engine will see it, in token ids: the model's own tokenizer and
chat template (`fleetllm.tokenizer`, the engine's code), with the engine's defaults for
`add_special_tokens` and `add_generation_prompt`.

Only what the router can reproduce exactly is tokenized: a chat request's text messages
(with `chat_template_kwargs`), or a single prompt (text or token ids). A request the engine
reads otherwise (tools, continuing the final message, several prompts, a suffix, truncation)
gives None, and the router routes it without knowing what is cached. A request whose prompt
logprobs are wanted is computed from scratch by the engine: it gives no tokens to look up.

Tokenizing costs the router's event loop time (the tokenizer holds the GIL), and chat
prompts mostly repeat: a shared system prompt, the earlier turns of a conversation. The
tokenizer cuts a text at its added tokens (a chat template's `<|im_start|>`, ...) before
anything else, and tokenizes each piece on its own; so a rendered chat is tokenized piece by
piece here, each piece's ids kept in a bounded cache, and only new pieces cost anything.
That holds for tokenizers whose added tokens match exactly (no stripping of the whitespace
around them, no normalization); for any other the whole text is tokenized.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fleetllm.tokenizer import Tokenizer

_UNREPRODUCED = ("tools", "continue_final_message", "documents", "chat_template", "suffix")
_TRUNCATION = ("truncate_prompt_tokens",)
CACHE_CHARS = 1 << 23
"""The text the piece cache keeps, in characters (with its ids, some tens of MB)."""


class PromptTokenizer:
    """One model's tokenizer, loaded from its model directory (tokenizer.json and its
    companions, as the engine loads them)."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        """Prompts longer than this are cut here: only their beginning keys the lookup."""
        self._added, self._split = _added_tokens(tokenizer)
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_chars = 0

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
        if add_special_tokens or self._split is None:
            ids = self.tokenizer.encode(cut, add_special_tokens=add_special_tokens)
        else:
            ids = self._encode_pieces(cut)
        return ids[: self.max_tokens]

    def _encode_pieces(self, text: str) -> list[int]:
        assert self._split is not None
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # an added token (the split's captured separators)
                ids.append(self._added[piece])
            elif piece:
                ids += self._piece(piece)
        return ids

    def _piece(self, piece: str) -> list[int]:
        ids = self._pieces.get(piece)
        if ids is not None:
            self._pieces.move_to_end(piece)
            return ids
        ids = self.tokenizer.encode(piece, add_special_tokens=False)
        if len(piece) <= CACHE_CHARS // 4:
            self._pieces[piece] = ids
            self._cached_chars += len(piece)
            while self._cached_chars > CACHE_CHARS:
                old, _ = self._pieces.popitem(last=False)
                self._cached_chars -= len(old)
        return ids


def _added_tokens(tokenizer: Tokenizer) -> tuple[dict[str, int], re.Pattern[str] | None]:
    """The tokenizer's added tokens (text -> id), and the pattern that cuts a text at them;
    None where the pieces would not tokenize as the whole (see the module's docstring)."""
    backend = tokenizer.backend
    added = backend.get_added_tokens_decoder()
    plain = all(
        not (t.lstrip or t.rstrip or t.single_word or (t.normalized and backend.normalizer))
        for t in added.values()
    )
    if not added or not plain:
        return {}, None
    by_text = {t.content: i for i, t in added.items()}
    # Longest first: where two added tokens start at one place, the longer one is taken.
    alternatives = sorted(by_text, key=len, reverse=True)
    return by_text, re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32
