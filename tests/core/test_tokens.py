"""The prompt-token estimate (core/tokens.py): text by the pieces GPT-4o's pre-tokenizer
cuts it into (and what long, unusual and non-ASCII pieces cost beyond one token), framing by
each dialect's published rule, a request's texts rounded once; images, audio, files, tools
and schemas by the providers' published rules; held against the providers' own reported
counts (token_examples.json); pure, never below three, never lowered by more content."""

from __future__ import annotations

import base64
import json
import math
import re
import struct
import types
import zlib
from pathlib import Path
from typing import Any

import pytest
from callboard.core.tokens import (
    ANTHROPIC_MAX_IMAGE_TOKENS,
    ANTHROPIC_REPLY_PRIMER,
    ANTHROPIC_SYSTEM_JOIN,
    ANTHROPIC_TOOL_PROMPT,
    ANTHROPIC_TURN_OVERHEAD,
    AUDIO_TOKENS_PER_SECOND,
    ENUM_INIT,
    ENUM_ITEM,
    FUNC_END,
    FUNC_INIT,
    GPT_4O_IMAGES,
    IMAGE_BASE,
    IMAGE_TILE,
    MESSAGE_OVERHEAD,
    MOST_TOKENS_PER_CHAR,
    NAME_OVERHEAD,
    PDF_PAGE_TOKENS,
    PROP_INIT,
    PROP_KEY,
    REPLY_PRIMER,
    TOOL_CALL_OVERHEAD,
    count_chat_tokens,
    estimate_prompt_tokens,
    estimate_prompts_tokens,
    image_rule_of,
    image_tokens,
    text_tokens,
    texts_tokens,
    unsized,
)
from callboard.messages import ChatMessage
from callboard.wire.openai import check_body
from hypothesis import given, settings
from hypothesis import strategies as st

EXAMPLES = json.loads((Path(__file__).parent / "token_examples.json").read_text())
DIALECTS = ["openai", "anthropic"]
FRAMING = MESSAGE_OVERHEAD + REPLY_PRIMER


def chat(*contents: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=c) for c in contents]


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def png_url(width: int, height: int) -> str:
    """A data URL of a PNG's signature and header: all a size needs."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    raw = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr
    raw += struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def image(url: str, detail: str | None = None) -> dict[str, Any]:
    spec = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": spec}


def function(name: str, description: str = "", properties: Any = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "description": description}
    if properties is not None:
        fn["parameters"] = {"type": "object", "properties": properties}
    return {"type": "function", "function": fn}


# -- text ---------------------------------------------------------------------------------------

_WS = r" \t\n\r\x0b\x0c"
O200K_PIECES_ASCII = re.compile(
    # o200k_base's pre-tokenizer with its Unicode classes written for ASCII (\p{L} the
    # letters, \p{N} the digits, \s the six whitespace characters)
    r"[^\r\nA-Za-z0-9]?[A-Z]*[a-z]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\nA-Za-z0-9]?[A-Z]+[a-z]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    rf"|[0-9]{{1,3}}| ?[^{_WS}A-Za-z0-9]+[\r\n/]*|[{_WS}]*[\r\n]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
)


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        ("", 0),
        ("a", 1),
        ("The end.", 3),  # "The", " end", "."
        ("ab cd", 2),
        ("a\tb", 2),  # a tab leads a word like a space
        ("foo(bar)", 3),  # "foo", "(bar", ")": a lone mark leads the word after it
        ("it's", 1),  # the contraction stays with its word
        ("2 + 2 = 4", 7),  # "2", " +", " ", "2", " =", " ", "4" (the cookbook's)
        ("x  12", 4),  # "x", " ", " ", "12": no space leads a digit
        ("1234567", 3),  # three digits a piece
        ("123456789", 3),
        ("3.14159", 4),
        ("\n\n\n", 1),
        ("       ", 1),
    ],
)
def test_text_is_counted_by_the_pre_tokenizers_pieces(text: str, pieces: int) -> None:
    """Texts whose every piece is one token of GPT-4o's (checked against o200k_base)."""
    assert text_tokens(text) == pieces == len(O200K_PIECES_ASCII.findall(text))


@settings(max_examples=500)
@given(st.text(st.characters(max_codepoint=127), max_size=60))
def test_a_text_is_never_counted_below_its_pieces(text: str) -> None:
    """Each pre-tokenizer piece is at least one token, so no estimate may be lower."""
    assert text_tokens(text) >= len(O200K_PIECES_ASCII.findall(text))


def test_long_and_unusual_pieces_cost_more_than_one_token() -> None:
    assert text_tokens(" information") == 2  # letters past the fourth (rounded up alone)
    assert text_tokens(" tiktoken" * 10) < text_tokens("/tiktoken" * 10)  # no space leads it
    assert text_tokens("x" * 40) > text_tokens("x" * 20) > text_tokens("x" * 8) > 1
    assert text_tokens(" APPLICABLE" * 10) > text_tokens(" Applicable" * 10)
    assert text_tokens("getElementById") >= 4  # "get", "Element", "By", "Id"


def test_digits_are_a_token_for_every_three() -> None:
    for n in range(1, 40):
        exact = math.ceil(n / 3)
        assert exact <= text_tokens("7" * n) <= exact + (n > 9)


def test_text_outside_ascii_costs_by_its_script() -> None:
    assert text_tokens("お誕生日おめでとう") == 8  # the cookbook's: 8 with o200k_base
    assert text_tokens("你" * 100) >= 70  # a CJK character is most of a token
    assert text_tokens(" naïve café") > text_tokens(" naive cafe")  # an accent splits a word
    assert text_tokens("\ud83d") >= 1  # a lone surrogate is counted, not an error
    assert text_tokens("👍" * 3) > text_tokens("ok")


@pytest.mark.parametrize(
    "contents",
    [("",), ("a",), ("abcd",), ("hello",), ("x" * 4000,), ("ab cd", "ef gh")],
)
def test_estimate_prompt_tokens(contents: tuple[str, ...]) -> None:
    texts = sum(text_tokens(c) for c in contents)  # one text, or texts of whole pieces
    expected = texts + MESSAGE_OVERHEAD * len(contents) + REPLY_PRIMER
    assert estimate_prompt_tokens(chat(*contents)) == expected
    wire = [{"role": "user", "content": c} for c in contents]
    assert count_chat_tokens(wire) == expected
    anthropic = texts + ANTHROPIC_TURN_OVERHEAD * len(contents) + ANTHROPIC_REPLY_PRIMER
    assert count_chat_tokens(wire, dialect="anthropic") == anthropic
    assert estimate_prompt_tokens(chat(*contents), dialect="anthropic") == anthropic


def test_a_request_rounds_its_texts_once() -> None:
    one = text_tokens("Hello")  # 1 piece and a letter past the fourth: 2 alone
    assert one == 2
    ten = count_chat_tokens([{"role": "user", "content": "Hello"}] * 10)
    assert 10 * 1 < ten - 10 * MESSAGE_OVERHEAD - REPLY_PRIMER < 10 * one


def test_an_empty_chat_costs_the_reply_primer() -> None:
    assert estimate_prompt_tokens(()) == count_chat_tokens(()) == REPLY_PRIMER == 3
    assert count_chat_tokens((), dialect="anthropic") == ANTHROPIC_REPLY_PRIMER == 4


def test_the_role_changes_only_anthropics_framing() -> None:
    def chat_as(role: str, dialect: str, n: int = 1) -> int:
        return estimate_prompt_tokens(
            [ChatMessage(role=role, content="ab cd")] * n, dialect=dialect
        )

    assert chat_as("system", "openai") == chat_as("user", "openai") == 2 + 4 + 3
    assert chat_as("assistant", "openai", 3) == 3 * (2 + MESSAGE_OVERHEAD) + REPLY_PRIMER
    # Anthropic: a system prompt is bare text; several are joined by a blank line
    assert chat_as("system", "anthropic") == 2 + ANTHROPIC_REPLY_PRIMER
    assert chat_as("system", "anthropic", 3) == 6 + 2 * ANTHROPIC_SYSTEM_JOIN + 4
    assert chat_as("user", "anthropic") == 2 + ANTHROPIC_TURN_OVERHEAD + ANTHROPIC_REPLY_PRIMER


@given(st.lists(st.text(max_size=200), max_size=8), st.text(max_size=50))
def test_an_estimate_is_at_least_the_primer_and_grows_with_every_message(
    contents: list[str], more: str
) -> None:
    before = estimate_prompt_tokens(chat(*contents))
    after = estimate_prompt_tokens(chat(*contents, more))
    assert isinstance(before, int)
    assert before >= REPLY_PRIMER
    assert after >= before + MESSAGE_OVERHEAD
    assert estimate_prompt_tokens(chat(*contents)) == before  # pure: the same answer again
    assert count_chat_tokens([{"role": "user", "content": c} for c in contents]) == before
    anthropic = estimate_prompt_tokens(chat(*contents, more), dialect="anthropic")
    assert anthropic >= estimate_prompt_tokens(chat(*contents), dialect="anthropic") + 3


def test_text_parts_count_as_texts() -> None:
    parts = user({"type": "text", "text": "ab"}, {"type": "text", "text": "cd"})
    assert count_chat_tokens(parts) == 2 + FRAMING  # "ab" and "cd", two pieces
    assert count_chat_tokens([{"role": "user", "content": "abcd"}]) == 1 + FRAMING


def test_a_name_a_tool_call_and_a_tool_answer_are_text_with_their_framing() -> None:
    named = [{"role": "user", "name": "example_user", "content": ""}]
    assert count_chat_tokens(named) == text_tokens("example_user") + NAME_OVERHEAD + FRAMING
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    asked = [{"role": "assistant", "content": None, "tool_calls": [call, call]}]
    # "f" one piece; '{"a":1}' five: '{"', "a", '":', "1", "}"
    assert count_chat_tokens(asked) == 2 * (TOOL_CALL_OVERHEAD + 1 + 5) + FRAMING
    answer = [{"role": "tool", "tool_call_id": "call_1", "content": "sun"}]
    assert count_chat_tokens(answer) == 3 + 1 + FRAMING  # "call", "_", "1"; "sun"


def test_a_chat_message_with_parts_is_estimated_as_its_wire_form() -> None:
    turns = [
        ChatMessage(
            role="user", content=({"type": "text", "text": "look"}, image(png_url(64, 64)))
        ),
        ChatMessage(
            role="assistant",
            content=None,
            tool_calls=(
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            ),
        ),
        ChatMessage(role="tool", content="done", tool_call_id="c1"),
        ChatMessage(role="user", content="plain", name="ann"),
    ]
    for dialect in DIALECTS:
        wire = [t.wire() for t in turns]
        expected = count_chat_tokens(wire, dialect=dialect)
        assert estimate_prompt_tokens(turns, dialect=dialect) == expected
    assert estimate_prompt_tokens(turns) > estimate_prompt_tokens(turns[1:]) + IMAGE_BASE


def test_an_unknown_dialect_is_named() -> None:
    with pytest.raises(ValueError, match="'gemini'"):
        count_chat_tokens([], dialect="gemini")
    with pytest.raises(ValueError, match="dialect"):
        image_tokens((10, 10), dialect="OpenAI")


# -- the providers' own figures ---------------------------------------------------------------


@pytest.mark.parametrize("case", EXAMPLES["images"], ids=lambda c: f"{c['dialect']}-{c['width']}")
def test_an_image_costs_what_its_provider_documents(case: dict[str, Any]) -> None:
    part = image(png_url(case["width"], case["height"]), case.get("detail"))
    text = {"type": "text", "text": "Describe this image"}
    without = count_chat_tokens(user(text), dialect=case["dialect"])
    added = count_chat_tokens(user(part, text), dialect=case["dialect"]) - without
    assert added == pytest.approx(case["tokens"], rel=0.10)
    assert added == case["tokens"]  # the published rules, applied exactly


def _named(section: str) -> Any:
    return pytest.mark.parametrize("case", EXAMPLES[section], ids=lambda c: c["name"])


@_named("chats")
def test_a_request_is_estimated_within_ten_percent_of_its_report(case: dict[str, Any]) -> None:
    estimate = count_chat_tokens(**case["request"], dialect=case["dialect"])
    assert estimate == pytest.approx(case["reported"], rel=0.10)
    assert estimate == case["estimate"]  # recorded, so a change of rule shows


@_named("texts")
def test_an_english_text_is_estimated_within_ten_percent(case: dict[str, Any]) -> None:
    estimate = text_tokens(case["text"])
    assert estimate == pytest.approx(case["reported"], rel=0.10)
    assert estimate == case["estimate"]


@_named("texts_counted")
def test_prose_code_json_and_numbers_are_estimated_within_ten_percent(
    case: dict[str, Any],
) -> None:
    estimate = text_tokens(case["text"])
    assert estimate == pytest.approx(case["reported"], rel=0.10)
    assert estimate == case["estimate"]


@_named("texts_other_languages")
def test_other_languages_are_estimated_reasonably_and_on_the_high_side(
    case: dict[str, Any],
) -> None:
    estimate = text_tokens(case["text"])
    assert 0.85 * case["reported"] <= estimate <= 1.5 * case["reported"]
    assert estimate == case["estimate"]


def test_every_example_names_its_source() -> None:
    sections = ("images", "chats", "texts", "texts_other_languages", "texts_counted")
    cases = [c for key in sections for c in EXAMPLES[key]]
    assert len(cases) == 41
    assert all(c["source"].startswith("https://") for c in cases)


# -- many texts at once -------------------------------------------------------------------------

_TRICKY = st.text(
    st.sampled_from([*"aZq09 \t\n\r\x0b'./(#-", "é", "你", "👍", "Д", "\ud83d", "\x00"]),
    max_size=40,
) | st.sampled_from(["", " ", "it's", "HTTPServer", "getElementById", "1234567890123", "x" * 30])


@settings(max_examples=400)
@given(st.lists(_TRICKY | st.text(max_size=30), max_size=12))
def test_texts_counted_together_count_as_each_alone(texts: list[str]) -> None:
    """Each text's neighbours change nothing: every mark a text's edge makes (a word's
    start, a run of blanks or digits, a contraction) is the same beside the separator."""
    assert texts_tokens(texts) == [text_tokens(t) for t in texts]


@settings(max_examples=400)
@given(_TRICKY | st.text(min_size=1, max_size=30))
def test_no_text_counts_more_than_three_tokens_a_character(text: str) -> None:
    assert text_tokens(text) <= MOST_TOKENS_PER_CHAR * len(text)


@pytest.mark.parametrize(
    "text", ["👍", "é", " 1 1 1", " \t.\t.", "  x  \n", "A", "x" * 40, "9" * 40]
)
def test_the_costliest_characters_stay_within_the_bound(text: str) -> None:
    assert text_tokens(text) <= MOST_TOKENS_PER_CHAR * len(text)


def test_many_texts_are_counted_in_several_passes_all_the_same() -> None:
    texts = [
        f"ticket #{i}: printer on floor {i % 7} jams, it's {'x' * (i % 40)}" for i in range(3000)
    ]
    texts[1234] = "word " * 5000  # one text longer than a pass on its own
    assert texts_tokens(texts) == [text_tokens(t) for t in texts]
    assert texts_tokens([]) == []


_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def _turn(kind: str, text: str) -> ChatMessage:
    """One turn of each shape a prompt may hold: plain text (the fast path), or one the
    general count reads (a name, tool calls, a tool's answer, parts, a refusal)."""
    if kind in ("system", "user", "assistant", "developer"):
        return ChatMessage(role=kind, content=text)
    if kind == "named":
        return ChatMessage(role="user", content=text, name="bob")
    if kind == "calls":
        return ChatMessage(role="assistant", content=None, tool_calls=(_CALL,))
    if kind == "answer":
        return ChatMessage(role="tool", content=text, tool_call_id="c1")
    if kind == "parts":  # a text part must hold some text
        return ChatMessage(role="user", content=({"type": "text", "text": text or "."},))
    return ChatMessage(role="assistant", content=text, refusal="no")


_TURNS = st.builds(
    _turn,
    st.sampled_from(
        ["system", "user", "assistant", "developer", "named", "calls", "answer", "parts", "no"]
    ),
    _TRICKY | st.text(max_size=30),
)


@settings(max_examples=300)
@given(st.lists(st.lists(_TURNS, max_size=5), max_size=8), st.sampled_from(DIALECTS))
def test_prompts_counted_together_count_as_each_alone(
    prompts: list[list[ChatMessage]], dialect: str
) -> None:
    """A burst's prompts, their plain turns counted in one pass, have each the estimate
    it has alone (its framing, the turns counted apart, one rounding)."""
    alone = [estimate_prompt_tokens(p, dialect=dialect) for p in prompts]
    assert estimate_prompts_tokens(prompts, dialect=dialect) == alone


def test_prompts_longer_than_a_pass_count_as_each_alone() -> None:
    prompts = [chat(f"ticket #{i}: it's {'x' * (i % 40)}", "ok") for i in range(2000)]
    prompts[7] = chat("word " * 20_000)  # longer than a piece: counted a piece at a time
    assert estimate_prompts_tokens(prompts) == [estimate_prompt_tokens(p) for p in prompts]
    assert estimate_prompts_tokens([]) == []


def test_the_recorded_texts_counted_together_keep_their_estimates() -> None:
    """Counted together, the recorded texts keep each its recorded estimate, so the
    ten percent rule holds for them as it does alone."""
    sections = ("texts", "texts_counted", "texts_other_languages")
    cases = [c for key in sections for c in EXAMPLES[key]]
    assert texts_tokens([c["text"] for c in cases]) == [c["estimate"] for c in cases]
    english = [c for key in sections[:2] for c in EXAMPLES[key]]
    total = sum(texts_tokens([c["text"] for c in english]))
    assert total == pytest.approx(sum(c["reported"] for c in english), rel=0.10)


# -- images -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "tiles"),
    [
        ((512, 512), 1),  # small images are not scaled up
        ((100, 30), 1),
        ((513, 100), 2),
        ((768, 768), 4),
        ((1536, 768), 6),  # short side already 768: 3 x 2 tiles
        ((4000, 1000), 4),  # fit to 2048 x 512 (short side already under 768): 4 x 1
        ((10_000, 100), 4),  # fit to 2048 x 20.48
    ],
)
def test_an_openai_image_costs_85_and_170_a_tile(size: tuple[int, int], tiles: int) -> None:
    assert (
        image_tokens(size, detail="high") == image_tokens(size) == IMAGE_BASE + IMAGE_TILE * tiles
    )


def test_a_low_detail_image_costs_85_whatever_its_size() -> None:
    for url in (png_url(4096, 8192), "https://example.com/huge.png"):
        assert count_chat_tokens(user(image(url, "low"))) == IMAGE_BASE + FRAMING


def test_an_image_of_unknown_size_costs_the_most_its_rule_allows() -> None:
    openai_most = max(
        image_tokens((w, h)) for w in range(64, 8192, 97) for h in (1, 768, 3000, 9000)
    )
    assert image_tokens(None) == openai_most == IMAGE_BASE + IMAGE_TILE * 8 == 1445
    anthropic_most = max(image_tokens((w, 5000), dialect="anthropic") for w in range(1, 9000, 77))
    assert image_tokens(None, dialect="anthropic") == anthropic_most == ANTHROPIC_MAX_IMAGE_TOKENS
    by_url = user(image("https://example.com/cat.jpg"))
    assert count_chat_tokens(by_url) == 1445 + FRAMING
    assert count_chat_tokens(by_url, dialect="anthropic") == ANTHROPIC_MAX_IMAGE_TOKENS + FRAMING


@pytest.mark.parametrize(
    ("model", "size", "tokens"),
    [  # OpenAI's "Images and vision", calculating costs: the rules and worked examples
        ("gpt-4o", (1024, 1024), 765),
        ("gpt-4o-2024-08-06", (2048, 4096), 1105),
        ("gpt-4.1", (1024, 1024), 765),
        ("gpt-4o-mini", (1024, 1024), 2833 + 4 * 5667),
        ("gpt-4o-mini-2024-07-18", (512, 512), 2833 + 5667),
        ("o1", (1024, 1024), 75 + 4 * 150),
        ("o3-2025-04-16", (1024, 1024), 75 + 4 * 150),
        ("gpt-5", (1024, 1024), 70 + 4 * 140),
        ("computer-use-preview", (1024, 1024), 65 + 4 * 129),
        ("gpt-4.1-mini", (1024, 1024), math.ceil(1024 * 1.62)),  # 32 x 32 patches
        ("gpt-4.1-mini-2025-04-14", (1800, 2400), math.ceil(1452 * 1.62)),  # shrunk: 33 x 44
        ("gpt-4.1-nano", (1024, 1024), math.ceil(1024 * 2.46)),
        ("gpt-5-mini", (100, 100), math.ceil(16 * 1.62)),
        ("gpt-5-nano", (4096, 4096), math.ceil(39 * 39 * 2.46)),  # shrunk to 39 x 39
        ("o4-mini", (64, 64), math.ceil(4 * 1.72)),
    ],
)
def test_an_openai_image_costs_what_its_models_rule_says(
    model: str, size: tuple[int, int], tokens: int
) -> None:
    """Every OpenAI model counted images as GPT-4o does: gpt-4o-mini, which bills one
    33 times as much, had budgets and token limits reserve a thirtieth of its cost."""
    assert image_tokens(size, images=image_rule_of(model)) == tokens


def test_an_image_counts_the_most_of_the_rules_given_and_the_text_once() -> None:
    """Counted once a rule, a 46-turn conversation without an image cost five times one
    count with five models' rules (found by a review): only its images differ."""
    rules = (GPT_4O_IMAGES, image_rule_of("gpt-4o-mini"), image_rule_of("gpt-4.1-nano"))
    picture = user({"type": "text", "text": "what is this?"}, image(png_url(1024, 1024)))
    most = max(image_tokens((1024, 1024), images=r) for r in rules)
    alone = count_chat_tokens(picture, images=(GPT_4O_IMAGES,))
    assert count_chat_tokens(picture, images=rules) - alone == most - 765
    talk = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    assert count_chat_tokens(talk, images=rules) == count_chat_tokens(talk)


def test_a_model_not_in_openais_table_counts_images_as_gpt_4o() -> None:
    for model in ("my-azure-deployment", "gpt-4o", "gpt-4", "gpt-5-codex-x", ""):
        rule = image_rule_of(model)
        assert rule == GPT_4O_IMAGES or model.startswith("gpt-5"), model
    assert image_rule_of("gpt-5-mini") != image_rule_of("gpt-5")  # the longest name wins
    assert image_rule_of("GPT-4o-Mini") == image_rule_of("gpt-4o-mini")
    mini = image_rule_of("gpt-4o-mini")
    for named in (
        "openai/gpt-4o-mini",
        "ft:gpt-4o-mini-2024-07-18:acme::9abc",
        "a/b/gpt-4o-mini",
        "openai/ft:gpt-4o-mini-2024-07-18:acme::9abc",  # a router's fine-tune
    ):
        assert image_rule_of(named) == mini, named  # a router's prefix, a fine-tune


def test_the_patch_rule_has_no_detail_and_an_unknown_size_costs_its_most() -> None:
    mini = image_rule_of("gpt-4.1-mini")
    low = count_chat_tokens(user(image(png_url(1024, 1024), "low")), images=(mini,))
    assert low == math.ceil(1024 * 1.62) + FRAMING  # low does not lower it
    by_url = count_chat_tokens(user(image("https://example.com/cat.jpg")), images=(mini,))
    assert by_url == math.ceil(1536 * 1.62) + FRAMING
    most = max(image_tokens((w, h), images=mini) for w in range(32, 9000, 331) for h in (1, 3000))
    assert most <= image_tokens(None, images=mini)
    tiles = image_rule_of("gpt-4o-mini")
    assert image_tokens(None, images=tiles) == 2833 + 8 * 5667
    assert image_tokens((4000, 4000), detail="low", images=tiles) == 2833


def test_an_anthropic_image_is_its_area_over_750_after_fitting_1568_pixels() -> None:
    assert image_tokens((1568, 784), dialect="anthropic") == ANTHROPIC_MAX_IMAGE_TOKENS  # 1639
    assert image_tokens((3136, 100), dialect="anthropic") == math.ceil(1568 * 50 / 750)
    assert image_tokens((30, 25), dialect="anthropic") == 1
    detail_is_openais = image(png_url(300, 300), "low")
    assert count_chat_tokens(user(detail_is_openais), dialect="anthropic") == 120 + FRAMING


# -- audio and files --------------------------------------------------------------------------


def wav_b64(seconds: float, rate: int = 8_000) -> str:
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    samples = b"\x00" * int(seconds * rate * 2)
    body = b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(samples))
    raw = b"RIFF" + struct.pack("<I", 4 + len(body) + len(samples)) + b"WAVE" + body + samples
    return base64.b64encode(raw).decode()


def pdf_url(pages: int) -> str:
    raw = b"%PDF-1.4\n" + b"<< /Type /Page >>\n" * pages + b"%%EOF"
    return "data:application/pdf;base64," + base64.b64encode(raw).decode()


def test_audio_costs_ten_tokens_a_second() -> None:
    clip = {"type": "input_audio", "input_audio": {"data": wav_b64(3.0), "format": "wav"}}
    assert count_chat_tokens(user(clip)) == 3 * AUDIO_TOKENS_PER_SECOND + FRAMING


def test_audio_it_cannot_time_is_timed_at_the_lowest_bitrate() -> None:
    garbage = base64.b64encode(b"\x00" * 16_000).decode()  # 16 kB, no header
    for fmt, seconds in (("wav", 16_000 / 8_000), ("mp3", 16_000 / 1_000)):
        clip = {"type": "input_audio", "input_audio": {"data": garbage, "format": fmt}}
        assert count_chat_tokens(user(clip)) == seconds * AUDIO_TOKENS_PER_SECOND + FRAMING


def test_a_pdf_costs_3000_tokens_a_page() -> None:
    doc = {"type": "file", "file": {"file_data": pdf_url(4), "filename": "a.pdf"}}
    assert count_chat_tokens(user(doc)) == 4 * PDF_PAGE_TOKENS + FRAMING
    by_id = {"type": "file", "file": {"file_id": "file-abc"}}
    assert count_chat_tokens(user(by_id)) == PDF_PAGE_TOKENS + FRAMING  # one page: unknowable


def test_a_file_without_pages_counts_its_bytes_as_text() -> None:
    notes = "data:text/plain;base64," + base64.b64encode(b"n" * 40_000).decode()
    doc = {"type": "file", "file": {"file_data": notes}}
    assert count_chat_tokens(user(doc)) == 10_000 + FRAMING


# -- tools and schemas ------------------------------------------------------------------------


# Tool texts below are made of short words (four letters at most, no run of capitals), whose
# every piece is one token: such texts add up exactly, whatever the rounding.


def test_a_function_costs_the_cookbooks_overheads_and_its_text() -> None:
    bare = [function("ping", "Is it up.")]
    line = text_tokens("ping:Is it up")  # "ping", ":Is", " it", " up"
    assert line == 4
    assert count_chat_tokens([], tools=bare) == 3 + FUNC_INIT + line + FUNC_END
    props = {
        "unit": {"type": "str", "description": "The unit.", "enum": ["cold", "hot"]},
        "n": {"type": ["int", "null"]},
    }
    expected = (
        FUNC_INIT
        + text_tokens("f:")
        + PROP_INIT
        + PROP_KEY
        + text_tokens("unit:str:The unit")
        + ENUM_INIT
        + 2 * ENUM_ITEM
        + text_tokens("cold")
        + text_tokens("hot")
        + PROP_KEY
        + text_tokens("n:int|null:")
        + FUNC_END
    )
    assert count_chat_tokens([], tools=[function("f", properties=props)]) == 3 + expected
    two = count_chat_tokens([], tools=[*bare, *bare])
    assert two == 3 + 2 * (FUNC_INIT + line) + FUNC_END


def test_nested_properties_are_counted_by_the_same_rule() -> None:
    leaf = {"zip": {"type": "str"}}
    flat = count_chat_tokens([], tools=[function("f", properties={"home": {"type": "obj"}})])
    nested = {"home": {"type": "obj", "properties": leaf}}
    listed = {"home": {"type": "list", "items": {"type": "obj", "properties": leaf}}}
    extra = PROP_INIT + PROP_KEY + text_tokens("zip:str:")
    assert count_chat_tokens([], tools=[function("f", properties=nested)]) == flat + extra
    listed_flat = count_chat_tokens(
        [], tools=[function("f", properties={"home": {"type": "list"}})]
    )
    assert count_chat_tokens([], tools=[function("f", properties=listed)]) == listed_flat + extra


def test_a_deep_schema_does_not_exhaust_the_recursion_limit() -> None:
    props: dict[str, Any] = {"leaf": {"type": "string"}}
    for _ in range(5_000):
        props = {"x": {"type": "object", "properties": props}}
    assert count_chat_tokens([], tools=[function("f", properties=props)]) > 5_000 * PROP_KEY


def test_a_schema_too_deep_for_json_dumps_is_written_all_the_same() -> None:
    deep: dict[str, Any] = {}
    for _ in range(5_000):
        deep = {"a": deep}
    text = '{"a":' * 5_000 + "{}" + "}" * 5_000
    fmt = {"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}
    got = count_chat_tokens([], response_format=fmt)
    assert got == 3 + FUNC_INIT + text_tokens("d:") + text_tokens(text) + FUNC_END
    as_tool = count_chat_tokens([], response_format=fmt, dialect="anthropic")
    wrapper = '{"name":"d","description":null,"input_schema":' + text + "}"
    assert as_tool == ANTHROPIC_REPLY_PRIMER + ANTHROPIC_TOOL_PROMPT + text_tokens(wrapper)
    nested: list[Any] = [1, "é"]
    for _ in range(5_000):
        nested = [nested, None]
    fmt = {"type": "json_schema", "json_schema": {"name": "d", "schema": {"enum": nested}}}
    text = '{"enum":' + "[" * 5_000 + '[1,"é"]' + ",null]" * 5_000 + "}"
    got = count_chat_tokens([], response_format=fmt)
    assert got == 3 + FUNC_INIT + text_tokens("d:") + text_tokens(text) + FUNC_END


def test_a_frozen_request_counts_like_the_plain_one() -> None:
    def freeze(value: Any) -> Any:
        if isinstance(value, dict):
            return types.MappingProxyType({k: freeze(v) for k, v in value.items()})
        return tuple(freeze(v) for v in value) if isinstance(value, list) else value

    (weather,) = [c for c in EXAMPLES["chats"] if c["name"].startswith("the cookbook's weather")]
    request = weather["request"]
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": [1, 2]}}}
    for dialect in DIALECTS:
        plain = count_chat_tokens(**request, response_format=schema, dialect=dialect)
        frozen = {k: freeze(v) for k, v in request.items()}
        assert count_chat_tokens(**frozen, response_format=freeze(schema), dialect=dialect) == plain


def test_anthropic_adds_its_tool_prompt_once_and_each_tool_as_json() -> None:
    tool = function("get_time", "The time.", {"tz": {"type": "string"}})
    as_sent = {
        "name": "get_time",
        "description": "The time.",
        "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}},
    }
    one = text_tokens(json.dumps(as_sent, separators=(",", ":")))
    base = ANTHROPIC_REPLY_PRIMER + ANTHROPIC_TOOL_PROMPT
    assert count_chat_tokens([], tools=[tool], dialect="anthropic") == base + one
    two = count_chat_tokens([], tools=[tool, tool], dialect="anthropic")
    assert base + 2 * one - 1 <= two <= base + 2 * one  # two texts, rounded once
    assert count_chat_tokens([], tools=[], dialect="anthropic") == ANTHROPIC_REPLY_PRIMER


def test_a_json_schema_is_framed_like_a_function_and_json_object_costs_nothing() -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "ok", "schema": schema, "strict": True},
    }
    text = text_tokens(json.dumps(schema, separators=(",", ":")))
    assert (
        count_chat_tokens([], response_format=fmt)
        == 3 + FUNC_INIT + text_tokens("ok:") + text + FUNC_END
    )
    for plain in ({"type": "json_object"}, {"type": "text"}, None):
        assert count_chat_tokens([], response_format=plain) == REPLY_PRIMER
    # Anthropic: the schema is asked through a forced tool, so it is one
    anthropic = count_chat_tokens([], response_format=fmt, dialect="anthropic")
    as_tool = {"name": "ok", "description": None, "input_schema": schema}
    expected = ANTHROPIC_REPLY_PRIMER + ANTHROPIC_TOOL_PROMPT
    assert anthropic == expected + text_tokens(json.dumps(as_tool, separators=(",", ":")))


# -- any request the wire accepts ---------------------------------------------------------------

NAMES = st.text(min_size=1, max_size=12)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
SCHEMA = st.recursive(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "object"]) | st.lists(NAMES, max_size=2)},
        optional={"description": st.text(max_size=30), "enum": st.lists(JSON, max_size=3)},
    ),
    lambda inner: st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(NAMES, inner, max_size=3)},
        optional={"items": inner},
    ),
    max_leaves=8,
)
IMAGE_URLS = (
    NAMES
    | st.builds(png_url, st.integers(1, 20_000), st.integers(1, 20_000))
    | st.binary(max_size=40).map(lambda b: "data:image/png;base64," + base64.b64encode(b).decode())
    | st.text(max_size=40).map(lambda t: "data:image/jpeg;base64,/9j/" + t)
)
USER_PARTS = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, NAMES),
    st.builds(image, IMAGE_URLS, st.none() | st.sampled_from(["auto", "low", "high"])),
    st.builds(
        lambda data, fmt: {"type": "input_audio", "input_audio": {"data": data, "format": fmt}},
        NAMES | st.builds(wav_b64, st.floats(0, 2)),
        st.sampled_from(["wav", "mp3"]),
    ),
    st.builds(lambda i: {"type": "file", "file": {"file_id": i}}, NAMES),
    st.builds(lambda d: {"type": "file", "file": {"file_data": d}}, NAMES | JSON.filter(bool)),
    st.builds(lambda n: {"type": "file", "file": {"file_data": pdf_url(n)}}, st.integers(0, 3)),
)
CALLS = st.lists(
    st.builds(
        lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}},
        NAMES,
        NAMES,
        st.text(max_size=40),
    ),
    min_size=1,
    max_size=2,
)


def _named(message: dict[str, Any], name: str | None) -> dict[str, Any]:
    return message if name is None else {**message, "name": name}


MESSAGES = st.lists(
    st.one_of(
        st.builds(
            lambda c, n: _named({"role": "user", "content": c}, n),
            st.text(max_size=80) | st.lists(USER_PARTS, max_size=4),
            st.none() | NAMES,
        ),
        st.builds(
            lambda r, c: {"role": r, "content": c},
            st.sampled_from(["system", "developer"]),
            st.text(max_size=80)
            | st.lists(st.builds(lambda t: {"type": "text", "text": t}, NAMES)),
        ),
        st.builds(lambda c: {"role": "assistant", "content": None, "tool_calls": c}, CALLS),
        st.builds(
            lambda c, r: {"role": "assistant", "content": c, "refusal": r},
            st.text(max_size=40),
            st.none() | st.text(max_size=20),
        ),
        st.builds(
            lambda c, i: {"role": "tool", "content": c, "tool_call_id": i},
            st.text(max_size=40),
            NAMES,
        ),
    ),
    min_size=1,
    max_size=5,
)
TOOLS = st.lists(
    st.builds(
        lambda n, d, p: {"type": "function", "function": {"name": n, **d, **p}},
        NAMES,
        st.just({}) | st.builds(lambda d: {"description": d}, JSON),
        st.just({})
        | st.builds(lambda s: {"parameters": s}, SCHEMA)
        | st.builds(lambda j: {"parameters": j}, st.dictionaries(st.text(max_size=8), JSON)),
    ),
    max_size=3,
)
FORMATS = (
    st.none()
    | st.sampled_from([{"type": "text"}, {"type": "json_object"}])
    | st.builds(
        lambda n, s: {"type": "json_schema", "json_schema": {"name": n, **s}},
        NAMES,
        st.just({}) | st.builds(lambda s: {"schema": s, "strict": True}, SCHEMA),
    )
)


def framing(messages: list[dict[str, Any]], dialect: str) -> int:
    """The least a chat's framing costs: OpenAI's per message; Anthropic's per turn, a
    system message bare (its first one: the join is counted for the others)."""
    if dialect != "anthropic":
        return REPLY_PRIMER + MESSAGE_OVERHEAD * len(messages)
    systems = sum(m["role"] in ("system", "developer") for m in messages)
    turns = len(messages) - systems
    return ANTHROPIC_REPLY_PRIMER + ANTHROPIC_TURN_OVERHEAD * turns + max(0, systems - 1)


@settings(max_examples=300, deadline=None)
@given(
    messages=MESSAGES,
    tools=TOOLS,
    response_format=FORMATS,
    more_messages=MESSAGES,
    more_tools=TOOLS,
    dialect=st.sampled_from(["openai", "azure", "anthropic"]),
)
def test_any_request_the_wire_accepts_is_counted_and_more_never_costs_less(
    *,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    response_format: dict[str, Any] | None,
    more_messages: list[dict[str, Any]],
    more_tools: list[dict[str, Any]],
    dialect: str,
) -> None:
    body: dict[str, Any] = {"messages": messages, "tools": tools or None}
    check_body({**body, "response_format": response_format})  # the strategies make real bodies
    count = count_chat_tokens(
        messages, tools=tools, response_format=response_format, dialect=dialect
    )
    assert isinstance(count, int)
    assert count >= framing(messages, dialect)
    again = count_chat_tokens(
        messages, tools=tools, response_format=response_format, dialect=dialect
    )
    assert again == count
    longer = count_chat_tokens(
        messages + more_messages,
        tools=tools + more_tools,
        response_format=response_format,
        dialect=dialect,
    )
    assert longer >= count + framing(more_messages, dialect) - framing([], dialect)
    without_format = count_chat_tokens(messages, tools=tools, dialect=dialect)
    assert without_format <= count


def test_a_file_by_id_is_content_of_unknown_size() -> None:
    """Its estimate (one page) bounds nothing: the budget reserves from the context
    window for it. Text, images and a file sent whole are sized."""
    by_id = {"type": "file", "file": {"file_id": "file-abc"}}
    pdf = "data:application/pdf;base64,JVBERi0="
    whole = {"type": "file", "file": {"file_data": pdf, "filename": "a.pdf"}}
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    text = {"type": "text", "text": "hi"}
    assert unsized([ChatMessage(role="user", content=(text, by_id))])
    assert not unsized([ChatMessage(role="user", content=(text, whole, image))])
    assert not unsized(chat("a plain turn"))


def test_a_long_text_is_counted_a_piece_at_a_time_to_the_same_total() -> None:
    """Each count is arithmetic on integers as long as its text, which holds the
    interpreter for all of it (317 ms at a time for a 31 MB prompt; a hunt): a long
    text is counted in pieces cut before spaces, to the same units as whole."""
    from callboard.core import tokens

    words = ["alpha", "Beta,", "gamma's", "1234567", "δέλτα", "\n", "e-mail", "x" * 40]
    text = " ".join(words[i * 7 % len(words)] for i in range(60_000))
    pieces = list(tokens._pieces(text))
    assert "".join(pieces) == text
    assert len(pieces) > 1
    assert all(len(p) <= tokens._PIECE_CHARS for p in pieces)
    assert tokens._text_units(text) == tokens._units(text)
    # counted with others (embeddings' inputs), the same number as alone, where a cut
    # counts a token more (no space in 300K characters of CJK: a review)
    cjk = "中文的句子这是一个测试" * 27_273
    assert tokens.texts_tokens(["a b", cjk, "c"]) == [
        tokens.text_tokens("a b"),
        tokens.text_tokens(cjk),
        tokens.text_tokens("c"),
    ]
    spaceless = "y" * (3 * tokens._PIECE_CHARS + 5)  # cut where it must, no space
    assert [len(p) for p in tokens._pieces(spaceless)] == [tokens._PIECE_CHARS] * 3 + [5]
