"""OpenAI's bodies in and out: what a chat or embeddings body becomes, and the answers
checked against the official SDK's own response types."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import pytest
from callboard.gateway.openai_api import (
    chat_call,
    chunk,
    completion_body,
    embed_call,
    embeddings_body,
    embeddings_json,
    encode,
    encode_pieces,
    models_body,
    plain,
    usage_chunk,
)
from callboard.messages import (
    MAX_INPUTS,
    Choice,
    Completed,
    EmbeddingResult,
    FrozenMap,
    InvalidRequestError,
    Priority,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import CreateEmbeddingResponse, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from callboard._embed import texts_of

HI = [{"role": "user", "content": "hi"}]
USAGE = Usage(prompt_tokens=9, completion_tokens=4, cached_tokens=2, reasoning_tokens=1)


def answered(**fields: Any) -> Completed:
    given: dict[str, Any] = {
        "task_id": 7,
        "trace_id": "t.7",
        "model": "fast",
        "content": "hello",
        "finish_reason": "stop",
        "usage": USAGE,
        **fields,
    }
    return Completed(**given)


# -- requests ---------------------------------------------------------------------------------


def test_known_fields_go_to_submit_and_the_rest_to_extra_body() -> None:
    call = chat_call(
        {
            "model": "fast",
            "messages": HI,
            "temperature": 0.5,
            "max_completion_tokens": 40,
            "tools": [],
            "metadata": {"run": "7"},  # OpenAI's stored-completions field, not callboard's
            "store": True,
            "top_k": 3,  # a provider's own
            "priority": "high",
        }
    )
    assert call.name == "fast"
    assert call.messages == HI
    assert call.fields == {
        "temperature": 0.5,
        "max_completion_tokens": 40,
        "tools": [],
        "extra_body": {"metadata": {"run": "7"}, "store": True, "top_k": 3},
    }
    assert call.priority is Priority.HIGH
    assert not call.stream


def test_a_stream_reads_its_usage_option() -> None:
    call = chat_call(
        {"model": "m", "messages": HI, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert call.stream
    assert call.include_usage
    assert "stream" not in call.fields
    assert "stream_options" not in call.fields
    assert not chat_call({"model": "m", "messages": HI, "stream": True}).include_usage


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ([], "the body must be a JSON object, got an array"),
        ({"messages": HI}, "model: required"),
        ({"model": " ", "messages": HI}, "model: required"),
        ({"model": "m"}, "messages: required"),
        ({"model": "m", "messages": "hello"}, "messages: must be an array of messages, got a str"),
        ({"model": "m", "messages": {"role": "user"}}, "messages: must be an array"),
        ({"model": "m", "messages": HI, "stream": "yes"}, "stream: must be true or false"),
        ({"model": "m", "messages": HI, "stream_options": {}}, "stream_options: only allowed"),
        ({"model": "m", "messages": HI, "stream": True, "stream_options": 1}, "stream_options"),
        ({"model": "m", "messages": HI, "extra_body": {}}, "extra_body: not a field"),
        ({"model": "m", "messages": HI, "priority": "urgent"}, "priority must be one of"),
    ],
)
def test_a_body_callboard_cannot_read_is_refused_naming_the_field(body: Any, named: str) -> None:
    with pytest.raises(InvalidRequestError, match=named):
        chat_call(body)


def test_an_embeddings_body_names_its_format() -> None:
    call = embed_call(
        {"model": "m", "input": ["a"], "encoding_format": "base64", "dimensions": 8, "x": 1}
    )
    assert call.base64
    assert call.fields == {"dimensions": 8, "extra_body": {"x": 1}}
    assert not embed_call({"model": "m", "input": "a"}).base64
    with pytest.raises(InvalidRequestError, match="encoding_format"):
        embed_call({"model": "m", "input": "a", "encoding_format": "int8"})
    with pytest.raises(InvalidRequestError, match="input: required"):
        embed_call({"model": "m"})


def test_an_embeddings_body_of_more_texts_than_openai_takes_is_refused() -> None:
    """A few bytes a text asked for gigabytes of vectors: 2,000,000 one-letter texts in a
    10 MB body took the gateway past 24 GB. At most ``MAX_INPUTS``, as OpenAI's API."""
    assert len(embed_call({"model": "m", "input": ["x"] * MAX_INPUTS}).input) == MAX_INPUTS
    with pytest.raises(InvalidRequestError, match=f"input: at most {MAX_INPUTS} texts"):
        embed_call({"model": "m", "input": ["x"] * (MAX_INPUTS + 1)})
    with pytest.raises(InvalidRequestError, match=f"input: at most {MAX_INPUTS} texts"):
        embed_call({"model": "m", "input": [[7]] * (MAX_INPUTS + 1)})


def test_one_list_of_token_ids_longer_than_the_texts_a_request_takes_is_one_input() -> None:
    """OpenAI's API takes one input of up to 8,192 token ids; 2,049 ids were refused as
    2,049 texts (found by a hunt)."""
    call = embed_call({"model": "m", "input": list(range(3000))})
    assert texts_of(call.input, "input") == ((tuple(range(3000)),), True)


@pytest.mark.parametrize(("ids", "bad"), [([1, -1], "input[1]"), ([7, 2**31], "input[1]")])
def test_a_token_id_out_of_range_is_named(ids: list[int], bad: str) -> None:
    """It said "input[0] must be a non-empty string or list of token ids, got int" of a
    good id (found by a hunt)."""
    with pytest.raises(InvalidRequestError, match=re.escape(f"{bad}: a token id is an integer")):
        embed_call({"model": "m", "input": ids})


# -- answers ------------------------------------------------------------------------------------


def test_an_answer_is_built_as_a_chat_completion_the_sdk_reads() -> None:
    body = completion_body(answered(), call_id="chatcmpl-7", created=1, raw_ok=False)
    completion = ChatCompletion.model_validate(json.loads(encode(body)))
    assert completion.choices[0].message.content == "hello"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 2
    assert completion.usage.completion_tokens_details is not None
    assert completion.usage.completion_tokens_details.reasoning_tokens == 1
    assert completion.usage.total_tokens == 13


def test_tool_calls_and_a_refusal_are_built_as_openai_writes_them() -> None:
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city":"Oslo"}')
    body = completion_body(
        answered(content="", tool_calls=(call,), finish_reason="tool_calls"),
        call_id="c",
        created=1,
        raw_ok=False,
    )
    message = ChatCompletion.model_validate(body).choices[0].message
    assert message.content is None
    assert message.tool_calls is not None
    assert message.tool_calls[0].function.arguments == '{"city":"Oslo"}'
    refused = completion_body(
        answered(content="", refusal="no"), call_id="c", created=1, raw_ok=False
    )
    assert refused["choices"][0]["message"] == {
        "role": "assistant",
        "content": None,
        "refusal": "no",
    }


def test_a_claude_models_thinking_is_said_as_litellm_says_it() -> None:
    """An answer of a model of Anthropic's dialect (its body no chat completion):
    ``reasoning_content`` and the signed ``thinking_blocks`` a tool loop sends back, as
    LiteLLM's proxy writes them; the next turn takes the message as it came."""
    signed = FrozenMap({"type": "thinking", "thinking": "hm", "signature": "EqQB"})
    result = answered(content="Paris", reasoning="hm", thinking_blocks=(signed,))
    body = completion_body(result, call_id="c", created=1, raw_ok=True)
    message = json.loads(encode(body))["choices"][0]["message"]
    assert message["reasoning_content"] == "hm"
    assert message["thinking_blocks"] == [signed]
    call = chat_call({"model": "m", "messages": [{"role": "user", "content": "x"}, message]})
    assert call.messages[1]["thinking_blocks"] == [signed]


def test_every_choice_is_answered_when_n_asked_for_several() -> None:
    choices = (
        Choice(index=0, content="a", finish_reason="stop"),
        Choice(index=1, content="b", finish_reason="length"),
    )
    body = completion_body(
        answered(content="a", choices=choices), call_id="c", created=1, raw_ok=False
    )
    completion = ChatCompletion.model_validate(body)
    assert [(c.index, c.message.content, c.finish_reason) for c in completion.choices] == [
        (0, "a", "stop"),
        (1, "b", "length"),
    ]


def test_the_providers_own_body_is_passed_on_when_it_speaks_openai() -> None:
    raw = {
        "id": "chatcmpl-upstream",
        "object": "chat.completion",
        "created": 5,
        "model": "gpt-4o-mini-2024-07-18",
        "system_fingerprint": "fp_1",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hello"},
                "finish_reason": "stop",
            }
        ],
    }
    result = answered(raw=raw)
    assert completion_body(result, call_id="c", created=1, raw_ok=True) is raw
    # in OpenAI's shapes: a call's arguments given as an object (some servers) passed on
    # so, and an SDK caller's json.loads raised (found by a hunt)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    odd = {**raw, "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]}
    passed = completion_body(answered(raw=odd), call_id="c", created=1, raw_ok=True)
    (read,) = passed["choices"][0]["message"]["tool_calls"]
    assert read["function"]["arguments"] == '{"a":1}'
    assert passed["system_fingerprint"] == "fp_1"  # the rest as the provider said it
    built = completion_body(result, call_id="c", created=1, raw_ok=False)  # another dialect's
    assert built["id"] == "c"
    assert "system_fingerprint" not in built
    assert (
        completion_body(answered(raw={"type": "message"}), call_id="c", created=1, raw_ok=True)[
            "object"
        ]
        == "chat.completion"
    )


def test_chunks_are_what_the_sdk_reads_from_a_stream() -> None:
    common: dict[str, Any] = {"call_id": "c", "created": 1, "model": "fast"}
    first = chunk(StreamDelta(text="he"), first=True, include_usage=True, **common)
    tool = chunk(
        StreamDelta(tool_calls=(ToolCallDelta(index=0, id="call_1", name="f", arguments="{"),)),
        first=False,
        include_usage=False,
        **common,
    )
    more = chunk(
        StreamDelta(tool_calls=(ToolCallDelta(index=0, arguments="}"),)),
        first=False,
        include_usage=False,
        **common,
    )
    last = chunk(StreamDelta(finish_reason="stop"), first=False, include_usage=False, **common)
    usage = usage_chunk(USAGE, **common)
    parsed = [ChatCompletionChunk.model_validate(e) for e in (first, tool, more, last, usage)]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[0].choices[0].delta.content == "he"
    assert first["usage"] is None  # every chunk says usage: null when it comes at the end
    calls = parsed[1].choices[0].delta.tool_calls
    assert calls is not None
    assert (calls[0].id, calls[0].type, calls[0].function and calls[0].function.name) == (
        "call_1",
        "function",
        "f",
    )
    assert "id" not in more["choices"][0]["delta"]["tool_calls"][0]
    assert parsed[3].choices[0].finish_reason == "stop"
    assert parsed[3].choices[0].delta.content is None
    assert parsed[4].choices == []
    assert parsed[4].usage is not None


def test_a_streamed_reasoning_goes_on_as_reasoning_content() -> None:
    """A reasoning model's streamed thinking (DeepSeek's, vLLM's ``reasoning_content``)
    was dropped from the gateway's stream, which its unstreamed answer kept (a hunt)."""
    common: dict[str, Any] = {"call_id": "c", "created": 1, "model": "fast"}
    thought = chunk(StreamDelta(reasoning="2+2"), first=True, include_usage=False, **common)
    parsed = ChatCompletionChunk.model_validate(thought)
    delta = parsed.choices[0].delta
    assert (delta.model_extra or {})["reasoning_content"] == "2+2"
    assert delta.content == ""


def test_a_streamed_tool_only_answer_has_no_content_and_logprobs_pass_on() -> None:
    """The SDK's accumulated message said ``content=""`` for a tool-only answer (the
    provider's said None), and every chunk's logprobs were dropped."""
    common: dict[str, Any] = {"call_id": "c", "created": 1, "model": "fast"}
    call = ToolCallDelta(index=0, id="call_1", name="f", arguments="{}")
    tool_first = chunk(StreamDelta(tool_calls=(call,)), first=True, include_usage=False, **common)
    assert ChatCompletionChunk.model_validate(tool_first).choices[0].delta.content is None
    lp = {"content": [{"token": "he", "logprob": -0.1, "bytes": [104, 101], "top_logprobs": []}]}
    text = chunk(StreamDelta(text="he", logprobs=lp), first=True, include_usage=False, **common)
    parsed = ChatCompletionChunk.model_validate(text).choices[0]
    assert parsed.delta.content == "he"
    assert parsed.logprobs is not None
    assert [t.token for t in parsed.logprobs.content or ()] == ["he"]


def test_embeddings_are_a_list_the_sdk_reads() -> None:
    result = EmbeddingResult(vectors=[[0.5, 1.0], [2.0, 0.25]], model="fast", usage=USAGE)
    response = CreateEmbeddingResponse.model_validate(embeddings_body(result, name="quick"))
    assert [d.embedding for d in response.data] == [[0.5, 1.0], [2.0, 0.25]]
    assert response.model == "fast"
    assert response.usage.prompt_tokens == response.usage.total_tokens == 9
    kept = EmbeddingResult(vectors_base64=["AAAAPw=="], model=None)
    assert embeddings_body(kept, name="quick")["data"][0]["embedding"] == "AAAAPw=="
    assert embeddings_body(kept, name="quick")["model"] == "quick"


def test_models_are_listed_as_the_sdk_reads_them() -> None:
    body = models_body([("fast", "callboard"), ("quick", "callboard:route")], created=0)
    assert [Model.model_validate(m).id for m in body["data"]] == ["fast", "quick"]


def test_plain_writes_callboards_values_as_json() -> None:
    from decimal import Decimal

    value = {"p": Priority.HIGH, "d": Decimal("0.10"), "s": frozenset({"b", "a"}), "u": USAGE}
    assert plain(value) == {
        "p": 1,
        "d": "0.10",
        "s": ["a", "b"],
        "u": {
            "prompt_tokens": 9,
            "completion_tokens": 4,
            "cached_tokens": 2,
            "reasoning_tokens": 1,
            "cache_write_tokens": 0,
            "cache_write_1h_tokens": 0,
            "estimated": False,
        },
    }
    assert json.loads(encode({"m": FrozenMap({"a": (1, 2)})})) == {"m": {"a": [1, 2]}}


def test_a_lone_surrogate_is_encoded_as_its_escape() -> None:
    """A provider's answer may carry a lone surrogate (as an escape); it goes back as
    the same escape, not as a 500 (UTF-8 has no form for it)."""
    assert json.loads(encode({"content": "a\ud800b", "é": 1})) == {"content": "a\ud800b", "é": 1}
    assert encode({"é": 1}) == '{"é":1}'.encode()  # UTF-8, unescaped, when it can be


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(), inner, max_size=4)
        | st.dictionaries(st.text(), inner, max_size=4).map(FrozenMap)
        | st.dictionaries(st.integers(), inner, min_size=1, max_size=2)
    ),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(value=JSON_VALUES, depth=st.integers(0, 6))
def test_an_answer_encoded_a_piece_at_a_time_is_the_same_json(value: Any, depth: int) -> None:
    """``encode_pieces`` writes the containers near the top itself and each value below
    them in one call into C (a whole answer in one call keeps every other thread
    waiting for its end): the same JSON as ``encode``, byte for byte but where a lone
    surrogate makes a piece, not the whole, its escapes."""
    whole, pieces = encode(value), encode_pieces(value, depth)
    assert json.loads(pieces) == json.loads(whole)
    if not re.search("[\ud800-\udfff]", json.dumps(value, ensure_ascii=False)):
        assert pieces == whole


def test_an_embeddings_answer_built_a_vector_at_a_time_is_the_same_json() -> None:
    result = EmbeddingResult(vectors=[[0.5, 1.0], [2.0, 0.25]], model="fast", usage=USAGE)
    written = embeddings_json(result, name="quick")
    assert json.loads(written) == embeddings_body(result, name="quick")
    assert written.startswith(b'{"object":"list","data":[{"object":"embedding","index":0,')


def test_a_number_past_a_doubles_range_goes_as_json() -> None:
    """A provider's ``1e400`` went on as ``Infinity``, which JSON.parse (openai-node, a
    browser) refuses, the whole answer with it (found by a hunt)."""
    answer = {"usage": {"completion_tokens": float("inf")}, "logprob": float("-inf"), "ok": 1.5}
    most = sys.float_info.max
    assert json.loads(encode(answer)) == {
        "usage": {"completion_tokens": most},
        "logprob": -most,
        "ok": 1.5,
    }
    assert b"Infinity" not in encode(answer)
    assert encode(FrozenMap({"x": float("inf")})) == b'{"x":1.7976931348623157e+308}'
    lone = encode({"t": "\ud800", "x": float("-inf")})  # the ASCII encoder's way, too
    assert lone == b'{"t":"\\ud800","x":-1.7976931348623157e+308}'
