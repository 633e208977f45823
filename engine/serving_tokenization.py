"""POST /tokenize and /detokenize, in vLLM's shapes, with the generation endpoints' tokenizer
and chat template."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetllm.engine.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest
from fleetllm.engine.request_fields import DETOKENIZE, TOKENIZE, TOKENIZE_CHAT
from fleetllm.engine.serving_base import OpenAIServing


@dataclass(frozen=True)
class OpenAIServingTokenization:
    serving: OpenAIServing

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """A prompt, or messages through the chat template, as token ids."""
        serving = self.serving
        serving.models.resolve(req.model)
        if isinstance(req, TokenizeChatRequest):
            serving.fields.check(req, TOKENIZE_CHAT)
            tools = [tool.model_dump(exclude_none=True) for tool in req.tools or ()]
            text = await serving.render_chat(req, tools)
        else:
            serving.fields.check(req, TOKENIZE)
            text = req.prompt
        tokens = await serving.encode(text, add_special_tokens=req.add_special_tokens)
        tokenizer = serving.tokenizer()
        return {
            "count": len(tokens),
            "max_model_len": serving.max_model_len,
            "tokens": tokens,
            "token_strs": tokenizer.convert_ids_to_tokens(tokens)
            if req.return_token_strs
            else None,
        }

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        serving = self.serving
        serving.models.resolve(req.model)
        serving.fields.check(req, DETOKENIZE)
        serving.check_token_ids(req.tokens, "tokens")
        return {"prompt": serving.tokenizer().decode(req.tokens)}
