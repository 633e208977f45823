"""What a request does to its prompt before the engine sees it: `truncate_prompt_tokens`
keeps the tokens vLLM keeps, the chat template gets the request's documents and reasoning
effort as vLLM gives them, and a chat answer takes the role and the echo vLLM gives it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetllm.engine.protocol import ChatCompletionRequest, TokenizeChatRequest
from fleetllm.engine.serving_base import message_text, template_variables
from fleetllm.engine.serving_chat import answer_role, echoed
from fleetllm.engine.serving_params import truncate_prompt
from fleetllm.errors import APIError

LIMIT = 64


@given(
    ids=st.lists(st.integers(0, 1000), min_size=1, max_size=3 * LIMIT),
    keep=st.integers(-1, LIMIT) | st.none(),
    side=st.sampled_from(["left", "right"]),
)
def test_truncation_keeps_the_first_or_last_tokens(
    ids: list[int], keep: int | None, side: str
) -> None:
    try:
        kept = truncate_prompt(ids, keep, side, LIMIT)
    except APIError as exc:
        assert keep == 0 and exc.param == "truncate_prompt_tokens"
        return
    if keep is None:
        assert kept is ids
        return
    wanted = LIMIT - 1 if keep == -1 else keep  # -1 leaves a token of context to generate
    assert len(kept) == min(len(ids), wanted)
    assert kept == (ids[len(ids) - len(kept) :] if side == "left" else ids[: len(kept)])


def test_truncation_past_the_context_is_refused_in_vllms_words() -> None:
    with pytest.raises(APIError) as err:
        truncate_prompt([1, 2], LIMIT + 1, "left", LIMIT)
    assert err.value.param == "truncate_prompt_tokens"
    assert err.value.message == (
        f"truncate_prompt_tokens={LIMIT + 1} cannot be greater than max_model_len = {LIMIT}. "
        "Please request a smaller truncation size."
    )


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_the_template_gets_documents_and_reasoning_effort_as_vllm_gives_them() -> None:
    docs = [{"title": "T", "text": "body"}]
    assert template_variables(chat()) == {}
    assert template_variables(chat(documents=docs, chat_template_kwargs={"x": 1})) == {
        "x": 1,
        "documents": docs,
    }
    assert template_variables(chat(reasoning_effort="low")) == {
        "reasoning_effort": "low",
        "enable_thinking": True,
    }
    assert template_variables(chat(reasoning_effort="none"))["enable_thinking"] is False
    # The client's own switch wins.
    kwargs = {"enable_thinking": False}
    assert template_variables(chat(reasoning_effort="high", chat_template_kwargs=kwargs)) == {
        "enable_thinking": False,
        "reasoning_effort": "high",
    }
    tokenize = TokenizeChatRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": 1}}
    )
    assert template_variables(tokenize) == {"x": 1}


def test_the_answer_continues_the_last_message_without_a_generation_prompt() -> None:
    messages = [
        {"role": "user", "content": "Name a colour."},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "The"}, {"type": "text", "text": "colour is"}],
        },
    ]
    plain = chat(messages=messages)
    assert (answer_role(plain), echoed(plain)) == ("assistant", "")
    continued = chat(messages=messages, add_generation_prompt=False, echo=True)
    assert (answer_role(continued), echoed(continued)) == ("assistant", "The\ncolour is")
    # With a generation prompt the answer is a new assistant message: nothing to echo after
    # a user's, but an assistant's last message is echoed, as vLLM does.
    assert echoed(chat(messages=messages[:1], echo=True)) == ""
    assert echoed(chat(messages=messages, echo=True)) == "The\ncolour is"
    user_last = chat(messages=messages[:1], add_generation_prompt=False, echo=True)
    assert (answer_role(user_last), echoed(user_last)) == ("user", "Name a colour.")


def test_message_text_of_each_content_shape() -> None:
    assert message_text({"role": "user", "content": "a"}) == "a"
    assert message_text({"role": "assistant", "content": None}) == ""
    assert message_text({"role": "user"}) == ""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}, "stray"]
    assert message_text({"role": "user", "content": parts}) == "a\nb"
