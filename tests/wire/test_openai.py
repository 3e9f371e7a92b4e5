"""OpenAI's Chat Completions wire (wire/openai.py, sans-IO): a stream's chunks assemble
into the answer the same call gives unstreamed (checked with the official ``openai``
SDK's own types)."""

from __future__ import annotations

import json
from typing import Any

import openai.types.chat as oa
import pytest
from callboard.wire.openai import MOST_TOOL_CALLS, ChunkAssembler, normal_completion
from hypothesis import given, settings
from hypothesis import strategies as st

# -- streams --------------------------------------------------------------------------------

# A streamed answer with a tool call, logprobs and usage in its last chunk, and the same
# answer unstreamed (API reference shapes).
CHUNKS: list[dict[str, Any]] = [
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": "Let me"},
                "logprobs": {
                    "content": [
                        {"token": "Let", "logprob": -0.1, "bytes": None, "top_logprobs": []}
                    ]
                },
                "finish_reason": None,
            }
        ],
    },
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o",
        "choices": [
            {
                "index": 0,
                "delta": {
                    "content": " check.",
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"ci'},
                        }
                    ],
                },
                "finish_reason": None,
            }
        ],
    },
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o",
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Paris"}'}}]},
                "finish_reason": "tool_calls",
            }
        ],
    },
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o",
        "choices": [],
        "usage": {"prompt_tokens": 50, "completion_tokens": 12, "total_tokens": 62},
    },
]


def test_a_streams_chunks_assemble_into_the_unstreamed_answer() -> None:
    assembler = ChunkAssembler()
    for chunk in CHUNKS:
        oa.ChatCompletionChunk.model_validate(chunk)  # the recording is the SDK's shape
        assembler.feed(chunk)
    answer = assembler.completion()
    oa.ChatCompletion.model_validate(answer)
    (choice,) = answer["choices"]
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["id"] == "call_9"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == "tool_calls"
    assert choice["logprobs"]["content"][0]["token"] == "Let"  # noqa: S105 - a token of text
    assert answer["usage"]["total_tokens"] == 62
    assert answer["id"] == "chatcmpl-1"


def test_a_legacy_function_call_and_the_serving_tier_are_kept_as_unstreamed() -> None:
    """The deprecated ``functions``' one call streams as ``delta.function_call`` and ends
    ``function_call``: it was dropped, the answer's message empty; and the tier that
    served the stream (which its bill follows) was lost from the answer (a hunt)."""
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {**head, "service_tier": "priority", "choices": [choice]}

    assembler = ChunkAssembler()
    for c in [
        chunk({"role": "assistant", "function_call": {"name": "weather", "arguments": ""}}),
        chunk({"function_call": {"arguments": '{"city": '}}),
        chunk({"function_call": {"arguments": '"Paris"}'}}),
        chunk({}, "function_call"),
    ]:
        oa.ChatCompletionChunk.model_validate(c)
        assembler.feed(c)
    answer = assembler.completion()
    oa.ChatCompletion.model_validate(answer)
    (choice,) = answer["choices"]
    assert choice["message"]["function_call"] == {
        "name": "weather",
        "arguments": '{"city": "Paris"}',
    }
    assert choice["finish_reason"] == "function_call"
    assert answer["service_tier"] == "priority"


def test_azures_prompt_annotation_chunk_does_not_blank_the_answers_id_and_model() -> None:
    """Azure's stream opens with the prompt's content filter results: ``choices`` empty
    and ``id``/``model`` blank, ``created`` 0 (Azure's content streaming docs); the
    answer's id and model are those of the chunks that carry them."""
    annotation = {
        "id": "",
        "object": "",
        "created": 0,
        "model": "",
        "choices": [],
        "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": {}}],
    }
    assembler = ChunkAssembler()
    for chunk in [annotation, *CHUNKS]:
        assembler.feed(chunk)
    answer = assembler.completion()
    assert (answer["id"], answer["model"]) == (CHUNKS[0]["id"], CHUNKS[0]["model"])
    assert answer["created"] == CHUNKS[0]["created"]


def test_choices_of_n_assemble_apart() -> None:
    assembler = ChunkAssembler(choices=2)
    for index, text in ((0, "a"), (1, "b"), (0, "c"), (1, "d")):
        assembler.feed({"id": "x", "choices": [{"index": index, "delta": {"content": text}}]})
    got = [c["message"]["content"] for c in assembler.completion()["choices"]]
    assert got == ["ac", "bd"]


def test_a_stream_is_finished_once_every_choice_is() -> None:
    assembler = ChunkAssembler(choices=2)
    assert not assembler.finished
    assembler.feed({"id": "x", "choices": [{"index": 0, "delta": {"content": "a"}}]})
    assembler.feed({"id": "x", "choices": [{"index": 1, "delta": {"content": "b"}}]})
    assembler.feed({"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    assert not assembler.finished, "choice 1 has not finished"
    assembler.feed({"id": "x", "choices": [{"index": 1, "delta": {}, "finish_reason": "length"}]})
    assert assembler.finished
    asked_two = ChunkAssembler(choices=2)  # choice 1 never began: not finished
    asked_two.feed({"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    assert not asked_two.finished


def test_a_streamed_refusals_logprobs_are_kept_as_unstreamed() -> None:
    """A refusal's tokens come in ``logprobs.refusal`` (the SDK's ``ChoiceLogprobs``)."""
    lp = {"token": "No", "logprob": -0.2, "bytes": None, "top_logprobs": []}
    chunk = {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o",
        "choices": [
            {
                "index": 0,
                "delta": {"refusal": "No."},
                "logprobs": {"content": None, "refusal": [lp]},
                "finish_reason": "stop",
            }
        ],
    }
    oa.ChatCompletionChunk.model_validate(chunk)
    assembler = ChunkAssembler()
    assembler.feed(chunk)
    answer = assembler.completion()
    oa.ChatCompletion.model_validate(answer)
    assert answer["choices"][0]["logprobs"] == {"content": None, "refusal": [lp]}


# -- tool calls numbered wrongly or not at all ----------------------------------------------

CALLS = [("call_1", "weather", '{"city":"Paris"}'), ("call_2", "time", '{"tz":"CET"}')]


def _tool_chunk(fragment: dict[str, Any]) -> dict[str, Any]:
    delta = {"tool_calls": [fragment]}
    return {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def _calls_of(chunks: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    assembler = ChunkAssembler()
    for chunk in chunks:
        assembler.feed(chunk)
    message = assembler.completion()["choices"][0]["message"]
    return [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ]


def _whole(ident: str, name: str, arguments: str, **index: int) -> dict[str, Any]:
    fn = {"name": name, "arguments": arguments}
    return _tool_chunk({"id": ident, "type": "function", "function": fn, **index})


def test_parallel_calls_sent_whole_without_an_index_stay_apart() -> None:
    """Gemini's OpenAI-compatible endpoint: each call whole in one fragment, no index."""
    assert _calls_of([_whole(*c) for c in CALLS]) == CALLS


def test_parallel_calls_all_at_index_0_stay_apart_by_their_ids() -> None:
    chunks = []
    for ident, name, arguments in CALLS:  # each split: its id first, its arguments after
        chunks.append(_whole(ident, name, arguments[:5], index=0))
        chunks.append(_tool_chunk({"index": 0, "function": {"arguments": arguments[5:]}}))
    assert _calls_of(chunks) == CALLS


def test_a_calls_id_repeated_in_every_fragment_is_one_call() -> None:
    chunks = [_whole("call_1", "weather", '{"city":', index=0)]
    chunks.append(_tool_chunk({"index": 0, "id": "call_1", "function": {"arguments": '"Paris"}'}}))
    assert _calls_of(chunks) == CALLS[:1]


def test_a_call_named_after_its_first_fragment_keeps_its_place() -> None:
    chunks = [_tool_chunk({"index": 0, "function": {"name": "weather", "arguments": ""}})]
    chunks.append(_tool_chunk({"index": 0, "id": "call_1", "function": {"arguments": '{"city"'}}))
    chunks.append(_tool_chunk({"index": 0, "function": {"arguments": ':"Paris"}'}}))
    assert _calls_of(chunks) == CALLS[:1]


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.text("abcdefgh", min_size=1, max_size=4), st.text("xyz{}:", max_size=12)),
        min_size=1,
        max_size=5,
        unique_by=lambda c: c[0],
    ),
    numbering=st.sampled_from(["openai", "none", "zero"]),
    cuts=st.lists(st.integers(0, 12), min_size=5, max_size=5),
)
def test_streamed_calls_assemble_as_sent_however_the_server_numbers_them(
    calls: list[tuple[str, str]], numbering: str, cuts: list[int]
) -> None:
    """Each call's first fragment names it; the rest of its arguments follow at the
    index the server gives (OpenAI's own, none, or 0 for every call): the reader and
    the assembly see the calls the server meant, each with its own arguments, and the
    deltas the reader gets carry the numbers the assembly gave them."""
    chunks = []
    for n, (name, arguments) in enumerate(calls):
        index = {"openai": {"index": n}, "none": {}, "zero": {"index": 0}}[numbering]
        cut = cuts[n] % (len(arguments) + 1)
        chunks.append(_whole(f"id_{name}", name, arguments[:cut], **index))
        if cut < len(arguments) and numbering != "none":  # no index: each call whole
            chunks.append(_tool_chunk({**index, "function": {"arguments": arguments[cut:]}}))
        elif cut < len(arguments):
            chunks[-1] = _whole(f"id_{name}", name, arguments)
    assembled = _calls_of(chunks)
    assert assembled == [(f"id_{name}", name, arguments) for name, arguments in calls]
    numbers = [c["choices"][0]["delta"]["tool_calls"][0]["index"] for c in chunks]
    assert numbers == sorted(numbers)  # renumbered in place: each call after the last


# -- servers that write the wire otherwise ------------------------------------------------

MAGISTRAL = {  # Mistral's reasoning models: content as parts (its docs, "Reasoning")
    "id": "m1",
    "object": "chat.completion",
    "created": 1,
    "model": "magistral-medium-2509",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": [{"type": "text", "text": "2+2 is 4."}]},
                    {"type": "text", "text": "The answer"},
                    {"type": "text", "text": " is 4."},
                ],
            },
            "finish_reason": "stop",
        }
    ],
}


def test_content_parts_are_read_as_the_text_and_the_thinking() -> None:
    """Every Magistral answer failed malformed (content not a string), sent four
    times, each an outage (found by a hunt): the text parts are the content, the
    thinking parts the reasoning, the answer as received left as it was."""
    normal = normal_completion(MAGISTRAL)
    message = normal["choices"][0]["message"]
    assert message["content"] == "The answer is 4."
    assert message["reasoning_content"] == "2+2 is 4."
    oa.ChatCompletion.model_validate(normal)
    assert isinstance(MAGISTRAL["choices"][0]["message"]["content"], list)  # untouched
    plain = {**MAGISTRAL, "choices": [{**MAGISTRAL["choices"][0], "message": message}]}
    assert normal_completion(plain) is plain  # nothing to read otherwise: the same body


def test_tool_arguments_given_as_an_object_are_read_as_their_json_text() -> None:
    """Some servers write a call's ``arguments`` as the object: passed on, an SDK's
    caller's ``json.loads`` raised, and streamed it was malformed (found by a hunt)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    body = {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "tool_calls": [call]}}],
    }
    (read,) = normal_completion(body)["choices"][0]["message"]["tool_calls"]
    assert json.loads(read["function"]["arguments"]) == {"a": 1}
    assembler = ChunkAssembler()
    assembler.feed({"choices": [{"index": 0, "delta": {"tool_calls": [{**call, "index": 0}]}}]})
    (assembled,) = assembler.completion()["choices"][0]["message"]["tool_calls"]
    assert json.loads(assembled["function"]["arguments"]) == {"a": 1}


def test_streamed_reasoning_and_content_parts_assemble_as_unstreamed() -> None:
    """DeepSeek's and vLLM's ``reasoning_content`` deltas, OpenRouter's ``reasoning``
    and Mistral's thinking parts were dropped from the assembled answer, which their
    unstreamed answers keep (found by a hunt); the deltas are read into OpenAI's
    shapes for the reader too."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    thinking = {"type": "thinking", "thinking": [{"type": "text", "text": "hm, "}]}
    chunks = [
        chunk({"role": "assistant", "reasoning_content": "2+2"}),
        chunk({"reasoning": "four"}),
        chunk({"content": [thinking]}),
        chunk({"content": [{"type": "text", "text": "It is"}]}),
        chunk({"content": " 4."}, "stop"),
    ]
    assembler = ChunkAssembler()
    for c in chunks:
        assembler.feed(c)
    message = assembler.completion()["choices"][0]["message"]
    assert message["content"] == "It is 4."
    assert message["reasoning_content"] == "2+2hm, "
    assert message["reasoning"] == "four"
    assert chunks[3]["choices"][0]["delta"]["content"] == "It is"  # the reader's, as text


def test_groqs_usage_in_its_own_field_is_the_streams_usage() -> None:
    """Groq's last chunk says the usage in ``x_groq.usage``: read only in ``usage``,
    the call was charged its estimate (found by a hunt)."""
    assembler = ChunkAssembler()
    assembler.feed({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]})
    usage = {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "x_groq": {"id": "r"}}
    assembler.feed({**last, "x_groq": {"id": "r", "usage": usage}})
    assert assembler.completion()["usage"] == usage


def test_a_choice_or_a_tool_call_past_what_an_answer_holds_is_a_malformed_stream() -> None:
    """Events that each named a new choice held 65 times their bytes, each a new tool
    call nine times (found by a hunt)."""
    assembler = ChunkAssembler(choices=2)
    assembler.feed({"id": "x", "choices": [{"index": 1, "delta": {"content": "b"}}]})
    with pytest.raises(IndexError, match="choice 2 of a stream that asked for 2"):
        assembler.feed({"id": "x", "choices": [{"index": 2, "delta": {}}]})
    calls = ChunkAssembler()
    for n in range(MOST_TOOL_CALLS):
        call = {"index": n, "id": f"call_{n}", "function": {"name": "f", "arguments": ""}}
        calls.feed({"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    one_more = {"index": MOST_TOOL_CALLS, "id": "call_x", "function": {"name": "f"}}
    with pytest.raises(IndexError, match=f"more than {MOST_TOOL_CALLS} tool calls"):
        calls.feed({"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [one_more]}}]})
