"""Request fields beyond what the engine's request models declare: vLLM's that the engine does
not serve, refused by name unless they ask for nothing, and fields nobody knows, ignored (as
OpenAI and vLLM do) but logged once per name, never with their value.

Clients that fill every field send vLLM's with their defaults (`"use_beam_search": false`,
`"priority": 0`), so each unserved field has the values that ask for nothing (`null` always
does); any other value is a behaviour the engine would otherwise drop without a word. A field
a request model declares is served by it, whatever this table says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from fleetllm.errors import bad_request

log = logging.getLogger("fleetllm.engine.requests")

MAX_LOGGED_NAMES = 256
"""Distinct unknown names logged per server: a client inventing names cannot flood the log."""
MAX_NAME_CHARS = 64

COMPLETION, CHAT = "completion", "chat"
TOKENIZE, TOKENIZE_CHAT, DETOKENIZE = "tokenize", "tokenize_chat", "detokenize"
GENERATION = frozenset({COMPLETION, CHAT})


def _is(*values: Any) -> Callable[[Any], bool]:
    """Neutral when equal to one of `values`, of the same JSON type (false is not 0)."""
    return lambda v: any(type(v) is type(x) and v == x for x in values)


def _empty(v: Any) -> bool:
    return v in ([], {}, "")


@dataclass(frozen=True)
class Unserved:
    neutral: Callable[[Any], bool]
    why: str
    endpoints: frozenset[str] = GENERATION


_WITH_MESSAGES = frozenset({CHAT, TOKENIZE_CHAT})

UNSERVED: Mapping[str, Unserved] = {
    "use_beam_search": Unserved(_is(False), "beam search is not supported"),
    "length_penalty": Unserved(_is(1, 1.0), "length_penalty applies to beam search only"),
    "watermarking": Unserved(_is(False), "watermarking is not supported"),
    "spaces_between_special_tokens": Unserved(
        _is(True), "special tokens are always detokenized with spaces between them"
    ),
    "logprob_token_ids": Unserved(_empty, "logprobs of chosen token ids are not supported"),
    "priority": Unserved(_is(0), "this server does not schedule by priority"),
    "return_tokens_as_token_ids": Unserved(
        _is(False), "logprob tokens are always returned as text"
    ),
    "return_token_offsets": Unserved(_is(False), "token offsets are not supported"),
    "routed_experts_prompt_start": Unserved(_is(0), "this model has no experts"),
    "return_prompt_text": Unserved(_is(False), "the prompt text is not returned"),
    "mm_payload": Unserved(_is("tensors"), "this model takes no multimodal input"),
    "return_mm_kwargs": Unserved(_is(False), "this model takes no multimodal input"),
    "kv_transfer_params": Unserved(_empty, "KV transfer is not supported"),
    "ec_transfer_params": Unserved(_empty, "encoder cache transfer is not supported"),
    "vllm_xargs": Unserved(_empty, "vllm_xargs are not supported"),
    "repetition_detection": Unserved(_empty, "repetition detection is not supported"),
    "stream_interval": Unserved(_is(1), "streams send every output as it comes"),
    "thinking_token_budget": Unserved(
        _is(-1), "this server has no reasoning parser to count thinking tokens"
    ),
    "prompt_embeds": Unserved(
        _empty, "prompt embeddings are not supported", frozenset({COMPLETION})
    ),
    # As vLLM refuses them unless started with --trust-request-chat-template: a template is
    # code run on the server.
    "chat_template": Unserved(
        lambda v: False,
        "a chat template passed with the request is refused: the model's own is used",
        _WITH_MESSAGES,
    ),
    "media_io_kwargs": Unserved(_empty, "this model takes no multimodal input", _WITH_MESSAGES),
    "mm_processor_kwargs": Unserved(_empty, "this model takes no multimodal input", _WITH_MESSAGES),
}


# vLLM's fields that ask for nothing this server would do otherwise: an identity (as OpenAI's
# `user` is), or a switch over output it never makes (no reasoning parser). Their
# type is checked; they are neither refused nor logged as unknown.
WITHOUT_EFFECT: Mapping[str, tuple[type, frozenset[str]]] = {
    "session_id": (str, GENERATION),
    "include_reasoning": (bool, frozenset({CHAT})),
}


_TYPE_NAMES = {str: "string", bool: "boolean"}


class FieldPolicy:
    """One server's check of the fields outside its request models, and its memory of the
    unknown names it has logged."""

    def __init__(self) -> None:
        self._logged: set[str] = set()

    def check(self, req: BaseModel, endpoint: str) -> None:
        """400 naming the first unserved field that asks for something; a WARNING for each
        unknown name not logged before."""
        extra = req.model_extra or {}
        for name, value in extra.items():
            kind, where = WITHOUT_EFFECT.get(name, (None, frozenset()))
            if kind is not None and endpoint in where:
                if value is not None and type(value) is not kind:
                    raise bad_request(f"{name}: must be a {_TYPE_NAMES[kind]}", name)
                continue
            unserved = UNSERVED.get(name)
            if unserved is not None and endpoint in unserved.endpoints:
                if value is not None and not unserved.neutral(value):
                    raise bad_request(f"{name}: {unserved.why}", name)
                continue
            self._log_unknown(name, endpoint)
        template_kwargs = getattr(req, "chat_template_kwargs", None)
        if template_kwargs and template_kwargs.get("chat_template") is not None:
            raise bad_request(
                f"chat_template_kwargs.chat_template: {UNSERVED['chat_template'].why}",
                "chat_template_kwargs",
            )

    def _log_unknown(self, name: str, endpoint: str) -> None:
        if name in self._logged or len(self._logged) > MAX_LOGGED_NAMES:
            return
        self._logged.add(name)
        if len(self._logged) > MAX_LOGGED_NAMES:
            log.warning(
                "unknown request fields: more names than are logged",
                extra={"logged_names": MAX_LOGGED_NAMES},
            )
            return
        shown = "".join(c if c.isprintable() else "?" for c in name[:MAX_NAME_CHARS])
        log.warning("unknown request field ignored", extra={"field": shown, "endpoint": endpoint})
