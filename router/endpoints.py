"""The endpoints the router relays: vLLM's model-addressed routes, each a POST of a JSON object
whose top-level `model` names the model (vLLM 0.32's OpenAI, pooling, tokenizer and Anthropic
routes). A replica that does not serve one answers with its own error, which is relayed as it
came. Each goes through the same keys, scopes, limits, routing and failover as chat.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    path: str
    what: str
    """What a client sends there, for the OpenAPI document."""
    salted: bool = True
    """Whether its requests reach the prefix cache and take vLLM's `cache_salt` (the router
    sets one per tenant)."""


ENDPOINTS = (
    Endpoint("/v1/completions", "an OpenAI completion request"),
    Endpoint("/v1/chat/completions", "an OpenAI chat completion request"),
    Endpoint("/v1/responses", "an OpenAI Responses API request"),
    Endpoint("/v1/embeddings", "an OpenAI embeddings request"),
    Endpoint("/pooling", "a vLLM pooling request"),
    Endpoint("/classify", "a vLLM classification request"),
    Endpoint("/score", "a vLLM score request"),
    Endpoint("/v1/score", "a vLLM score request (vLLM's older path)"),
    Endpoint("/rerank", "a rerank request (Jina's and Cohere's shape)"),
    Endpoint("/v1/rerank", "a rerank request (vLLM's older path)"),
    Endpoint("/v2/rerank", "a rerank request (Cohere's v2 path)"),
    Endpoint("/v1/messages", "an Anthropic Messages API request"),
    Endpoint("/v1/messages/count_tokens", "an Anthropic token count request", salted=False),
    Endpoint("/tokenize", "a vLLM tokenize request", salted=False),
    Endpoint("/detokenize", "a vLLM detokenize request", salted=False),
)

BY_PATH = {e.path: e for e in ENDPOINTS}
