"""The engine's request models by endpoint, each with the least body it accepts: the tests of
field handling start from these and add the fields under test."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from fleetllm.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from fleetllm.engine.request_fields import CHAT, COMPLETION, DETOKENIZE, TOKENIZE, TOKENIZE_CHAT

MESSAGES = [{"role": "user", "content": "hi"}]
ENDPOINTS: dict[str, tuple[type[BaseModel], dict[str, Any]]] = {
    COMPLETION: (CompletionRequest, {"prompt": "hi"}),
    CHAT: (ChatCompletionRequest, {"messages": MESSAGES}),
    TOKENIZE: (TokenizeCompletionRequest, {"prompt": "hi"}),
    TOKENIZE_CHAT: (TokenizeChatRequest, {"messages": MESSAGES}),
    DETOKENIZE: (DetokenizeRequest, {"tokens": [1]}),
}
