"""Prompt-size estimates: how many tokens a chat will cost before it is sent.

Theory of operation
-------------------
The limiter reserves ``prompt + max_tokens`` tokens before a call and a budget
reserves its cost, so every request needs a prompt estimate at the front
door: computed once, cheaply, on the caller's thread, and not below what the
provider will report. Nothing here holds a vocabulary; text is counted by the
pieces a tokenizer's pre-tokenizer would cut it into, everything else by the
providers' published rules (cited beside each constant).

* Text (``text_tokens``): GPT-4o's tokenizer (o200k_base) first cuts text
  with a regular expression into pieces (a word with the one space or mark
  before it, up to three digits, a run of punctuation, a run of whitespace),
  then encodes each piece on its own; a common English word is one token, so
  the pieces alone come within a few percent of the count. The pieces are
  counted here without running that expression: each character gets a class,
  and a piece starts where the class changes (a letter after a non-letter, an
  upper-case letter after a lower-case one, and so on), so the count is a few
  passes over the bytes in C (``bytes.translate`` and masks held as Python
  integers, a byte a character) instead of a regex match per piece. Then what
  the pieces miss: letters past the fourth (and again past the twelfth) in a
  piece, a long piece not led by a space (an identifier, a path, a rare word
  costs two to four tokens), runs of capitals, and characters outside ASCII
  by their script, read from the UTF-8 lead byte (a CJK character ~3/4 of a
  token, an accented Latin letter ~1, Cyrillic ~1/5 on top of its word).
  Against the real tokenizer (the examples in ``tests/core/token_examples.json``,
  and texts of each kind) a text of 2 kB or more lands within about 15% for
  English prose, code and JSON and exactly for numbers, usually a little
  above; other scripts are estimated on the high side.
* A message costs its text plus framing. OpenAI (the cookbook, GPT-4o era):
  3 per message, 1 for its role, 3 to prime the reply, a ``name`` its text + 1.
  Anthropic (its token counting docs and SDK): a system prompt goes in as
  bare text (each system message after the first 1, the blank line the wire
  joins them with), each turn is framed like ``\n\nHuman:``, 3, and 4 prime
  the reply. A message whose content is a list of parts counts each text part
  as a text. An assistant's tool call costs its function name and arguments
  as text + 3; a tool message's ``tool_call_id`` its text. A request's texts
  are added up in 96ths of a token and rounded up once, so many short texts
  do not each round up.
* Images (``image_tokens``): OpenAI's rule for the model (``image_rule_of``:
  a base and a price per 512 px tile, which differ by model, 85 + 170 for
  GPT-4o and 2,833 + 5,667 for gpt-4o-mini; or, for gpt-4.1-mini and -nano,
  gpt-5-mini and -nano and o4-mini, 32 px patches, at most 1,536, times the
  model's multiplier), or Anthropic's area rule with ``dialect="anthropic"``.
  The size is read from a base64 data URL's header (``core.media``); an image
  we cannot measure (an http(s) URL) costs the most the rule allows, so a
  reservation is never too low for it.
* Audio: 10 tokens a second of input audio (OpenAI), the length read from the
  clip's header; a clip we cannot read is timed at the lowest bitrate the
  format uses, which overstates it.
* Files: 3,000 tokens a page (the top of Anthropic's 1,500-3,000 a page; both
  providers put a page's text and an image of it in the prompt). A file sent
  by ``file_id`` is counted as one page: its size is not in the request.
* Tools, OpenAI: the cookbook's ``num_tokens_for_tools`` for the GPT-4o
  family (per function, per property and per enum item overheads), with
  nested properties (objects, and the items of arrays) counted by the same
  rule. Anthropic: each tool's JSON text, plus the system prompt the API adds
  when tools are present (346 tokens on current models).
* ``response_format`` ``json_schema``: no provider publishes a rule. OpenAI:
  the schema's compact JSON text, plus its name and description, framed like
  one function definition (7 + 12 tokens). Anthropic: our wire asks for a
  schema through a forced tool, so it is counted as one more tool.

The simulated provider reports ``prompt_tokens`` with ``count_chat_tokens``
itself, so on the simulator an estimate and the reported usage agree exactly.

What always holds: an estimate is an ``int`` >= 3; it is pure (the same
messages give the same answer); adding a message, a part or a tool never
lowers it (appending characters to one text can, by a token, as it can with a
real tokenizer: ``it'`` is two pieces, ``it's`` one); and no JSON-shaped
request that ``wire.openai.check_body`` accepts makes it raise (a part it
cannot read is skipped or costed at its upper bound, never an error).

Known limit: Claude Opus 4.7 brought a new tokenizer that Anthropic says uses
up to 1.35x the tokens of earlier models for the same text
(https://platform.claude.com/docs/en/about-claude/models/migration-guide);
this estimate follows the earlier models, whose published counts it matches.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TypeGuard

from callboard.core import media
from callboard.messages import ChatMessage

__all__ = [
    "ANTHROPIC_REPLY_PRIMER",
    "ANTHROPIC_SYSTEM_JOIN",
    "ANTHROPIC_TURN_OVERHEAD",
    "DIALECTS",
    "GPT_4O_IMAGES",
    "MESSAGE_OVERHEAD",
    "MOST_TOKENS_PER_CHAR",
    "REPLY_PRIMER",
    "ImageRule",
    "count_chat_tokens",
    "estimate_prompt_tokens",
    "estimate_prompts_tokens",
    "image_rule_of",
    "image_tokens",
    "inputs_tokens",
    "text_tokens",
    "texts_tokens",
]

DIALECTS = frozenset({"openai", "azure", "anthropic"})
"""Whose rules count images and tools (Azure serves OpenAI's models: OpenAI's)."""

# OpenAI, "How to count tokens with tiktoken", num_tokens_from_messages (gpt-4o family):
# https://github.com/openai/openai-cookbook/blob/main/examples/How_to_count_tokens_with_tiktoken.ipynb
MESSAGE_OVERHEAD = 4
"""OpenAI: tokens of framing per message (``tokens_per_message`` 3, and the role's 1)."""
REPLY_PRIMER = 3
"""OpenAI: tokens that prime the assistant's reply (``<|start|>assistant<|message|>``)."""
NAME_OVERHEAD = 1
"""A message's ``name`` costs its text and this (OpenAI cookbook, ``tokens_per_name``)."""
TOOL_CALL_OVERHEAD = 3
"""An assistant's tool call costs its name and arguments as text and this (our figure for
the call's framing; no provider publishes one)."""

# Anthropic counts a system prompt and a greeting ("You are a scientist", "Hello, Claude")
# as 14 tokens (https://docs.claude.com/en/docs/build-with-claude/token-counting) and a
# lone "Hello, world" as 10 (anthropic-sdk-python v0.39.0 README, "Token counting"): 7
# tokens of framing either way, the text as GPT-4o counts it.
ANTHROPIC_TURN_OVERHEAD = 3
"""Anthropic: tokens of framing per user or assistant turn (a ``\\n\\nHuman:`` marker)."""
ANTHROPIC_SYSTEM_JOIN = 1
"""Anthropic: a system (or developer) message is bare text, but the wire joins several
into the one ``system`` prompt with a blank line: each after the first costs this."""
ANTHROPIC_REPLY_PRIMER = 4
"""Anthropic: tokens that prime the reply (the start of the prompt and ``\\n\\nAssistant:``)."""
_SYSTEM_ROLES = frozenset({"system", "developer"})

# OpenAI, "How to count tokens with tiktoken", num_tokens_for_tools (gpt-4o, gpt-4o-mini):
# https://github.com/openai/openai-cookbook/blob/main/examples/How_to_count_tokens_with_tiktoken.ipynb
FUNC_INIT = 7
"""Per function definition."""
PROP_INIT = 3
"""Per function (or nested object) that has properties."""
PROP_KEY = 3
"""Per property."""
ENUM_INIT = -3
"""Per property with a (non-empty) enum list."""
ENUM_ITEM = 3
"""Per enum value, besides its text."""
FUNC_END = 12
"""Once per request with tools."""

ANTHROPIC_TOOL_PROMPT = 346
"""The system prompt Anthropic adds when a request has tools: 346 tokens with tool choice
auto or none (313 with any or a named tool) on Claude 4 models and Sonnet 3.7; the older
Opus 3 costs 530 with auto. https://docs.claude.com/en/docs/agents-and-tools/tool-use/overview#pricing"""

# OpenAI, "Images and vision", calculating costs:
# https://platform.openai.com/docs/guides/images-vision#calculating-costs
IMAGE_BASE = 85
"""Every image costs this on GPT-4o; a ``detail: low`` image costs only this."""
IMAGE_TILE = 170
"""Per 512 px tile of a high-detail image on GPT-4o, after it is scaled to fit 2048 x 2048
and then to a shortest side of at most 768 px."""
_TILE_PX, _FIT_PX, _SHORT_PX = 512, 2048, 768
_PATCH_PX, MAX_PATCHES = 32, 1536
"""The patch rule's square, and the most patches an image is scaled down to."""


@dataclass(frozen=True, slots=True)
class ImageRule:
    """How a family of OpenAI's models counts an image: ``base`` + ``tile`` per 512 px
    tile (``base`` alone at ``detail: low``), or, when ``patches`` is set, the 32 px
    patches that cover it (at most 1,536) times ``patches``, whatever the detail."""

    base: int = IMAGE_BASE
    tile: int = IMAGE_TILE
    patches: Fraction | None = None


GPT_4O_IMAGES = ImageRule()
"""GPT-4o's rule, also GPT-4.1's and GPT-4.5's, and the one taken for a model not listed."""
_IMAGE_RULES: dict[str, ImageRule] = {
    "gpt-4o-mini": ImageRule(base=2833, tile=5667),
    "gpt-5": ImageRule(base=70, tile=140),
    "o1": ImageRule(base=75, tile=150),
    "o3": ImageRule(base=75, tile=150),
    "computer-use-preview": ImageRule(base=65, tile=129),
    "gpt-4.1-mini": ImageRule(patches=Fraction("1.62")),
    "gpt-4.1-nano": ImageRule(patches=Fraction("2.46")),
    "gpt-5-mini": ImageRule(patches=Fraction("1.62")),
    "gpt-5-nano": ImageRule(patches=Fraction("2.46")),
    "o4-mini": ImageRule(patches=Fraction("1.72")),
}
"""OpenAI's table, by model name (a dated snapshot, ``gpt-4o-mini-2024-07-18``, is its
model's)."""


def image_rule_of(model: str) -> ImageRule:
    """The rule of the longest name in OpenAI's table that ``model`` is or begins (then
    a ``-``), read past a router's prefix (``openai/gpt-4o-mini``) and within a
    fine-tune's name (``ft:gpt-4o-mini-2024-07-18:org::id``); GPT-4o's for any other
    (an Azure deployment is named by its owner, so its model is not known: GPT-4o's
    too)."""
    name = model.lower().rsplit("/", 1)[-1].removeprefix("ft:").split(":", 1)[0]
    while True:
        rule = _IMAGE_RULES.get(name)
        if rule is not None:
            return rule
        cut = name.rfind("-")
        if cut <= 0:
            return GPT_4O_IMAGES
        name = name[:cut]


# Anthropic, "Vision", evaluate image size: tokens = width * height / 750, after an image
# whose long edge exceeds 1568 px or whose cost exceeds ~1,600 tokens is scaled down.
# https://docs.claude.com/en/docs/build-with-claude/vision#evaluate-image-size
ANTHROPIC_PIXELS_PER_TOKEN = 750
ANTHROPIC_LONG_EDGE_PX = 1568
ANTHROPIC_MAX_IMAGE_TOKENS = 1600

AUDIO_TOKENS_PER_SECOND = 10
"""OpenAI: one token per 100 ms of input audio.
https://platform.openai.com/docs/guides/realtime-costs"""
_LOWEST_BYTES_PER_SECOND = {"wav": 8_000, "mp3": 1_000}
"""For a clip whose header we cannot read: 8 kHz 8-bit mono WAV, 8 kbit/s MP3."""

PDF_PAGE_TOKENS = 3000
"""Anthropic: "each page typically uses 1,500-3,000 tokens", text and image of the page.
https://docs.claude.com/en/docs/build-with-claude/pdf-support#estimate-your-costs"""


def _is_anthropic(dialect: str) -> bool:
    if dialect not in DIALECTS:
        raise ValueError(f"dialect must be one of {sorted(DIALECTS)}, got {dialect!r}")
    return dialect == "anthropic"


# -- text -----------------------------------------------------------------------------------
# o200k_base's pre-tokenizer (tiktoken, openai_public.py), which this counts the pieces of:
#   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{C}?
#   |[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{C}?
#   |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
# where {C} is (?i:'s|'t|'re|'ve|'m|'ll|'d).
# Read as where pieces start:
# * a word: at a letter after a non-letter, or an upper-case letter after a lower-case one
#   ("HTTPServer" is one piece, "getElementById" four); it takes the one space, tab or
#   mark before it, but a mark only when it stands alone and not after a space (".js"
#   and "(obj" are one piece each, " (" and "((" are pieces of their own); "'s", "'t",
#   "'re", "'ve", "'m", "'ll" and "'d" end the word before them;
# * digits: a piece for every three;
# * marks: a run is a piece, with the one space before it and the line breaks after it;
# * whitespace: a run holding line breaks is a piece up to its last break; a run of
#   spaces or tabs after that gives its last character to the word after it, so it is a
#   piece only if longer than one; before a digit it is a piece and its last space
#   another; at the end of the text, one piece.
# Every character outside ASCII counts as a letter here (a word of them is one piece), and
# its script adds what it costs on top, read from its UTF-8 lead byte.
# The weights were fitted (then rounded up) against o200k_base on prose, code, JSON,
# numbers and text in 24 languages; they are in 96ths of a token.


def _table(pairs: Sequence[tuple[bytes, int]]) -> bytes:
    table = bytearray(256)
    for chars, value in pairs:
        for char in chars:
            table[char] = value
    return bytes(table)


_LOWER, _UPPER, _DIGIT, _SPACE, _TAB, _BREAK, _MARK, _OTHER = (1 << k for k in range(8))
_BLANKS = b" \t\x0b\x0c"
_CLASS = bytes(
    _table(
        [
            (bytes(range(0x61, 0x7B)), _LOWER),
            (bytes(range(0x41, 0x5B)), _UPPER),
            (bytes(range(0x30, 0x3A)), _DIGIT),
            (b" ", _SPACE),
            (_BLANKS[1:], _TAB),
            (b"\r\n", _BREAK),
            (bytes(range(0x80, 0x100)), _OTHER),
        ]
    ).replace(b"\x00", bytes([_MARK]))
)
"""A character class a byte, a bit each (ASCII punctuation and controls are marks)."""

_CONTRACTION = re.compile(r"'(?:[sStTmMdD]|[rRvV][eE]|[lL][lL])(?![A-Za-z\x80-\U0010ffff])")
"""A contraction the pre-tokenizer keeps with the word before it, if one is before it."""
_IS_LETTER = re.compile(r"[A-Za-z\x80-\U0010ffff]").fullmatch
"""What counts as a letter here: ASCII letters, and every character outside ASCII."""

_UNIT = 96
_LETTER_PAST_4 = 9
"""Each letter of a piece past its fourth (``information`` 7), and again past its twelfth."""
_UNLED_8 = 60
"""A piece of 8 letters or more not led by a space: an identifier, a path, a rare word."""
_UNLED_13 = 30
"""And again at 13 letters or more."""
_CAPITAL_RUN = 6
"""Each capital after a capital (``WARRANTY``)."""
_SCRIPT_LEAD = _table(
    [
        (bytes(range(0xC3, 0xCA)), 1),  # Latin letters with accents
        (b"\xc2" + bytes(range(0xCA, 0xD0)), 2),  # Latin-1 signs, IPA, combining marks, Greek
        (bytes(range(0xD0, 0xD5)), 3),  # Cyrillic
        (bytes(range(0xD5, 0xE0)), 4),  # Armenian, Hebrew, Arabic, Syriac, Thaana
        (b"\xe0", 5),  # Indic scripts, Thai, Lao, Tibetan
        (b"\xe1\xe2", 6),  # Vietnamese letters, Georgian, punctuation, symbols
        (bytes(range(0xE3, 0xEA)) + b"\xee\xef", 7),  # CJK, kana, fullwidth forms
        (bytes(range(0xEA, 0xEE)), 8),  # Hangul
        (bytes(range(0xF0, 0xF8)), 9),  # emoji and the rest beyond the BMP
    ]
)
"""A character outside ASCII by its UTF-8 lead byte (continuation bytes: 0)."""
_SCRIPT_COST = ((1, 108), (2, 30), (3, 18), (4, 24), (5, 30), (6, 48), (7, 72), (8, 42), (9, 144))
"""What a character of each script adds to its piece, in 96ths (a CJK character 3/4)."""

MOST_TOKENS_PER_CHAR = 3
"""No text counts more than this many tokens a character (``len(text)``), so a text
shorter than a third of a limit needs no count to be within it. A character costs at
most 2.5 tokens: a blank starts at most two pieces (a run's last before a mark, a digit
or the end, and a run of two or more); an ASCII letter starts one and adds at most
114/96 for a long piece; a character outside ASCII starts one and adds at most 144/96
for its script; a digit starts one or adds at most 96/96 past the ninth. Rounding a
text up keeps it within 3 a character."""

_CACHED_CHARS = 256
"""Texts up to this long are remembered (system prompts repeat): 4,096 of them at most."""


def text_tokens(text: str) -> int:
    """The tokens GPT-4o's tokenizer is expected to make of ``text``: its pre-tokenizer's
    pieces, and what long, unusual or non-ASCII pieces cost beyond one token (see the
    module's theory of operation). 0 for the empty text, otherwise at least 1."""
    return -(-_text_units(text) // _UNIT)


def _text_units(text: str) -> int:
    """``text_tokens`` in 96ths of a token: a request adds these up and rounds once."""
    if len(text) <= _CACHED_CHARS:
        return _cached_text_units(text)
    if len(text) <= _PIECE_CHARS:
        return _units(text)
    return sum(_units(piece) for piece in _pieces(text))


_PIECE_CHARS = 1 << 16
"""A longer text is counted a piece of at most this many characters at a time: each
count is arithmetic on integers as long as its text, which holds the interpreter for
its whole length (a 31 MB prompt held it 317 ms at a time; found by a hunt)."""


def _pieces(text: str) -> Iterator[str]:
    """``text`` in pieces of at most ``_PIECE_CHARS``, each cut just before a space where
    there is one (where the pre-tokenizer starts a piece of its own too)."""
    start, end = 0, len(text)
    while end - start > _PIECE_CHARS:
        cut = text.rfind(" ", start + 1, start + _PIECE_CHARS)
        if cut <= start:
            cut = start + _PIECE_CHARS
        yield text[start:cut]
        start = cut
    yield text[start:end]


def _units(text: str) -> int:
    raw = text.encode("utf-8", "surrogatepass")
    if not raw:
        return 0
    gained, lost, last, _, digit, upper, lower, starts, after_space, other = _marks(raw, _CLASS)
    pieces = gained.bit_count() - lost.bit_count()
    pieces += raw[-1] in _BLANKS and (len(raw) == 1 or raw[-2] not in _BLANKS)  # at the end
    units = 0
    if digit:
        first, fourth, seventh, tenth, tenth_starts = _digit_marks(digit)
        pieces += (last & (digit >> 8) | first << 1 | fourth << 2 | seventh << 3).bit_count()
        units += _UNIT // 3 * (tenth.bit_count() + 2 * tenth_starts.bit_count())
    if "'" in text:
        pieces -= _contractions(text)
    units += _UNIT * pieces + _CAPITAL_RUN * (upper & (upper << 8)).bit_count()
    past_4, past_12, unled_8, unled_13 = _letter_marks(lower | upper, starts, after_space)
    if past_4:
        units += _LETTER_PAST_4 * (past_4 | past_12 << 1).bit_count()
        units += _UNLED_8 * unled_8.bit_count() + _UNLED_13 * unled_13.bit_count()
    if other:
        leads = raw.translate(_SCRIPT_LEAD)
        units += sum(cost * leads.count(script) for script, cost in _SCRIPT_COST)
    return units


_cached_text_units = functools.lru_cache(maxsize=4096)(_units)


def _marks(raw: bytes, classes: bytes) -> tuple[int, int, int, int, int, int, int, int, int, int]:
    """The pre-tokenizer's marks on ``raw`` (see the comment above ``_table``), each in
    bit 0 of every byte: ``gained``, the pieces that start at a byte (up to five, a bit
    each); ``lost``, the starts it merges into the piece before (up to two); and the
    masks of blanks, digits, capitals, small letters, a word's start, a byte after a
    space and bytes outside ASCII. A byte ``classes`` gives no class (the separator
    between texts counted together) stands as the edge of a text does, so each text is
    marked as it would be alone. (A plain tuple: a text alone costs some 6 us, and a
    named one added two.)"""
    ones = int.from_bytes(b"\x01" * len(raw), "little")
    x = int.from_bytes(raw.translate(classes), "little")
    lower, upper, digit, space, tab, newline, mark, other = ((x >> k) & ones for k in range(8))
    letter, blank = lower | upper | other, space | tab
    after_letter, after_space, after_mark = letter << 8, space << 8, mark << 8
    starts = (letter ^ (letter & after_letter)) | (upper & (lower << 8))
    runs = mark ^ (mark & after_mark)
    lone = runs ^ (runs & (mark >> 8))
    prefix = lone & (letter >> 8)
    prefix ^= prefix & after_space
    breaks = newline ^ (newline & (newline << 8))
    last = blank ^ (blank & (blank >> 8))
    longer = last & (blank << 8)
    # pieces that start here, each mask in its own bit of the byte: one count for all
    gained = (
        starts
        | runs << 1
        | breaks << 2
        | (longer ^ (longer & (newline >> 8))) << 3
        | (last & tab & (mark >> 8)) << 4
    )
    lost = prefix | (breaks & after_mark) << 1
    return gained, lost, last, blank, digit, upper, lower, starts, after_space, other


def _digit_marks(digit: int) -> tuple[int, int, int, int, int]:
    """A piece for every three digits of a run: at its first, fourth and seventh digit
    (exact to nine digits); past the ninth a third of a token a digit (``tenth``) and
    two thirds more a run (``tenth_starts``), which rounds the run up."""
    d3 = digit & (digit << 8) & (digit << 16)
    d4 = d3 & (digit << 24)
    first = digit ^ (digit & (digit << 8))
    if not d4:
        return first, 0, 0, 0, 0
    d7 = d4 & (d3 << 32)
    d10 = d7 & (d3 << 56)
    return first, d4 ^ (d4 & (d4 << 8)), d7 ^ (d7 & (d7 << 8)), d10, d10 ^ (d10 & (d10 << 8))


def _letter_marks(ascii_letter: int, starts: int, after_space: int) -> tuple[int, int, int, int]:
    """What long pieces cost beyond their one token: letters past the fourth and past
    the twelfth, and pieces of 8 or 13 letters not led by a space (at their 8th and
    13th letter)."""
    inner = ascii_letter ^ (ascii_letter & starts)
    i2 = inner & (inner << 8)
    i4 = i2 & (i2 << 16)
    if not i4:
        return 0, 0, 0, 0
    unled = starts ^ (starts & after_space)
    i7 = i4 & (i2 << 32) & (inner << 48)
    i12 = i4 & (i4 << 32) & (i4 << 64)
    return i4, i12, i7 & (unled << 56), i12 & (unled << 96)


# -- many texts at once ---------------------------------------------------------------------
# Counted alone, a short text costs some 10 us, most of it the fixed cost of a few dozen
# big-integer operations. ``texts_tokens`` marks many texts in one pass: their UTF-8 joined
# by 0xFF (a byte UTF-8 never holds), which has no class, so each mark beside it is what it
# is at the edge of a text alone. The marks become bytes (a byte's pieces; its cost beyond
# them in 96ths, at most 144, so no byte carries into the next), and each text adds up the
# bytes of its own span and rounds up, as ``text_tokens`` does.

_SEPARATOR = b"\xff"
_JOINED_CLASS = _CLASS[:255] + b"\x00"
_IS_SEPARATOR = _table([(_SEPARATOR, 1)])
_POPCOUNT = bytes(b.bit_count() for b in range(256))
_SCRIPT_UNITS = bytes(dict(_SCRIPT_COST).get(script, 0) for script in _SCRIPT_LEAD)
"""A byte's cost beyond its piece by its script, in 96ths (lead bytes only)."""
_JOINED_BYTES = 1 << 14
"""About how many bytes are marked in one pass (measured: the pass costs more a byte as
its integers outgrow the cache)."""


def texts_tokens(texts: Sequence[str]) -> list[int]:
    """``text_tokens`` of each text, counted together: the same numbers, several times
    faster for many short texts (a text longer than ``_PIECE_CHARS`` on its own, a piece
    at a time, as ``text_tokens`` counts it)."""
    return [-(-units // _UNIT) for units in _texts_units(texts)]


def _texts_units(texts: Sequence[str]) -> list[int]:
    """``_text_units`` of each text, counted together (``texts_tokens`` before rounding)."""
    if any(len(t) > _PIECE_CHARS for t in texts):
        short = [t for t in texts if len(t) <= _PIECE_CHARS]
        counted = iter(_texts_units(short))
        return [_text_units(t) if len(t) > _PIECE_CHARS else next(counted) for t in texts]
    encoded = [t.encode("utf-8", "surrogatepass") for t in texts]
    counts: list[int] = []
    start = size = 0
    for end, raw in enumerate(encoded, 1):
        size += len(raw) + 1
        if size >= _JOINED_BYTES or end == len(encoded):
            counts += _joined_units(texts[start:end], encoded[start:end])
            start, size = end, 0
    return counts


def inputs_tokens(inputs: Sequence[str | Sequence[int]]) -> list[int]:
    """The tokens of each input to embed: a text's ``text_tokens`` (counted together, as
    ``texts_tokens``), an array of token ids its length."""
    if all(type(i) is str for i in inputs):
        return texts_tokens(inputs)  # type: ignore[arg-type]  # every one a str
    texts = [i for i in inputs if type(i) is str]
    counted = iter(texts_tokens(texts))
    return [next(counted) if type(i) is str else len(i) for i in inputs]


def _joined_units(texts: Sequence[str], encoded: Sequence[bytes]) -> list[int]:
    """``_text_units`` of each of ``texts`` (their UTF-8 ``encoded``), marked in one pass."""
    joined = _SEPARATOR.join(encoded)
    n = len(joined)
    if not n:
        return [0] * len(texts)
    gained, lost, last, blank, digit, upper, lower, starts, after_space, other = _marks(
        joined, _JOINED_CLASS
    )
    pieces = _per_byte(gained, n) - _per_byte(lost, n)  # never below 0 in a byte
    ends = int.from_bytes(joined.translate(_IS_SEPARATOR), "little") >> 8 | 1 << 8 * (n - 1)
    pieces += blank & ~(blank << 8) & ends  # a text that ends in one blank
    extra = _CAPITAL_RUN * (upper & (upper << 8))
    if digit:
        first, fourth, seventh, tenth, tenth_starts = _digit_marks(digit)
        pieces += (last & (digit >> 8)) + first + fourth + seventh
        extra += _UNIT // 3 * (tenth + 2 * tenth_starts)
    past_4, past_12, unled_8, unled_13 = _letter_marks(lower | upper, starts, after_space)
    if past_4:
        extra += _LETTER_PAST_4 * (past_4 + past_12) + _UNLED_8 * unled_8 + _UNLED_13 * unled_13
    if other:
        extra += int.from_bytes(joined.translate(_SCRIPT_UNITS), "little")
    piece_bytes, extra_bytes = pieces.to_bytes(n, "little"), extra.to_bytes(n, "little")
    counts = []
    at = 0
    for text, raw in zip(texts, encoded, strict=True):
        stop = at + len(raw)
        units = _UNIT * sum(piece_bytes[at:stop]) + sum(extra_bytes[at:stop])
        if "'" in text:
            units -= _UNIT * _contractions(text)
        counts.append(units)
        at = stop + 1
    return counts


def _per_byte(mask: int, n: int) -> int:
    """How many bits of each of ``mask``'s ``n`` bytes are set, a count a byte."""
    return int.from_bytes(mask.to_bytes(n, "little").translate(_POPCOUNT), "little")


def _contractions(text: str) -> int:
    """Contractions ending a word (``it's``, ``we're``), which the pieces counted apart:
    after a letter, and not right after another (in ``A'd'd`` the second is a piece)."""
    count, end = 0, -1
    for found in _CONTRACTION.finditer(text):
        start = found.start()
        if start and start != end and _IS_LETTER(text[start - 1]):
            count += 1
            end = found.end()
    return count


# -- messages -------------------------------------------------------------------------------
# Everything below counts in 96ths of a token (``_UNIT``), so a request's texts are added up
# before they are rounded, once, up.


def estimate_prompt_tokens(
    messages: Sequence[ChatMessage],
    *,
    dialect: str = "openai",
    images: Sequence[ImageRule] = (GPT_4O_IMAGES,),
) -> int:
    """``count_chat_tokens`` of the messages alone; a plain text turn takes the fast
    path, its text and its framing."""
    return _estimate(messages, dialect, images, _text_units)


def estimate_prompts_tokens(
    prompts: Sequence[Sequence[ChatMessage]],
    *,
    dialect: str = "openai",
    images: Sequence[ImageRule] = (GPT_4O_IMAGES,),
) -> list[int]:
    """``estimate_prompt_tokens`` of each prompt, the plain text turns of all of them
    counted together (``texts_tokens``): the same numbers, a short prompt 3.1 us against
    8.9 us alone (a burst's submit counts its prompts so)."""
    plain = [m.content for messages in prompts for m in messages if _plain(m)]
    counted = iter(_texts_units(plain))  # type: ignore[arg-type]  # each a str (_plain)

    def taken(_text: str) -> int:  # each plain turn's count, in the order counted
        return next(counted)

    return [_estimate(messages, dialect, images, taken) for messages in prompts]


def _estimate(
    messages: Sequence[ChatMessage],
    dialect: str,
    images: Sequence[ImageRule],
    text_units: Callable[[str], int],
) -> int:
    """The estimate of ``messages``, each plain turn's text counted by ``text_units``."""
    frames = _Framing(_is_anthropic(dialect))
    units = 0
    for m in messages:
        if _plain(m):
            units += text_units(m.content) + frames.next(m.role)  # type: ignore[arg-type]
        else:
            wire = m.wire()
            units += _message(wire, dialect, images) + frames.next(wire.get("role"))
    return frames.primer + -(-units // _UNIT)


def _plain(m: ChatMessage) -> bool:
    """A turn of text alone: counted as its text and its framing (the fast path)."""
    return (
        type(m.content) is str
        and m.name is None
        and m.tool_calls is None
        and m.tool_call_id is None
        and m.refusal is None
        and m.thinking_blocks is None
        and m.reasoning_content is None
    )


def count_chat_tokens(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    response_format: Mapping[str, Any] | None = None,
    dialect: str = "openai",
    images: Sequence[ImageRule] = (GPT_4O_IMAGES,),
) -> int:
    """The prompt tokens of a Chat Completions request's messages, tools and response
    format, by ``dialect``'s rules (``openai``, ``azure`` or ``anthropic``); with
    OpenAI's, each image by the costliest of ``images``, the rules of the models that
    may serve it (the rest of the prompt is counted once whatever their number)."""
    anthropic = _is_anthropic(dialect)
    frames = _Framing(anthropic)
    units = sum(
        _message(m, dialect, images) + frames.next(m.get("role"))
        for m in messages
        if isinstance(m, Mapping)
    )
    defined = [t for t in tools or () if isinstance(t, Mapping)]
    schema = _schema_tool(response_format)
    if anthropic:
        defined += [schema] if schema is not None else []
        if defined:
            units += _UNIT * ANTHROPIC_TOOL_PROMPT + sum(_anthropic_tool(t) for t in defined)
    else:
        if defined:
            units += sum(_openai_function(t.get("function")) for t in defined)
            units += _UNIT * FUNC_END
        if schema is not None:
            units += _openai_schema(schema)
    return frames.primer + -(-units // _UNIT)


class _Framing:
    """A request's message framing, message by message: OpenAI's per message; Anthropic's
    per turn, a system message being bare text (joined to the one before it)."""

    __slots__ = ("anthropic", "primer", "systems")

    def __init__(self, anthropic: bool) -> None:
        self.anthropic = anthropic
        self.primer = ANTHROPIC_REPLY_PRIMER if anthropic else REPLY_PRIMER
        self.systems = 0

    def next(self, role: object) -> int:
        """The framing of the next message, in units."""
        if not self.anthropic:
            return _UNIT * MESSAGE_OVERHEAD
        if role in _SYSTEM_ROLES:
            self.systems += 1
            return _UNIT * ANTHROPIC_SYSTEM_JOIN if self.systems > 1 else 0
        return _UNIT * ANTHROPIC_TURN_OVERHEAD


def _message(message: Mapping[str, Any], dialect: str, images: Sequence[ImageRule]) -> int:
    """A message's content, name, refusal and tool calls, without its framing."""
    content = message.get("content")
    if isinstance(content, str) and len(message) <= 2:  # role and text: the common turn
        return _text_units(content)
    units = _content(content, dialect, images)
    if isinstance(message.get("refusal"), str):
        units += _text_units(message["refusal"])
    if isinstance(message.get("name"), str):
        units += _text_units(message["name"]) + _UNIT * NAME_OVERHEAD
    if isinstance(message.get("tool_call_id"), str):
        units += _text_units(message["tool_call_id"])
    calls = message.get("tool_calls")
    if _is_array(calls):
        units += sum(_tool_call(c) for c in calls if isinstance(c, Mapping))
    if isinstance(message.get("reasoning_content"), str) and not _is_anthropic(dialect):
        units += _text_units(message["reasoning_content"])  # if sent back (sends_back)
    blocks = message.get("thinking_blocks")
    if _is_array(blocks):  # to Claude, or a proxy in front of it (sends_back)
        units += sum(
            _text_units(_text(b.get("thinking"))) for b in blocks if isinstance(b, Mapping)
        )
    return units


def _content(content: object, dialect: str, images: Sequence[ImageRule]) -> int:
    """A message's content: a text, or parts (each text part a text)."""
    if isinstance(content, str):
        return _text_units(content)
    units = 0
    for part in content if _is_array(content) else ():
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("text", "refusal") and isinstance(part.get(kind), str):
            units += _text_units(part[kind])
        elif kind == "image_url":
            units += _UNIT * _image_part(part.get("image_url"), dialect, images)
        elif kind == "input_audio":
            units += _UNIT * _audio_part(part.get("input_audio"))
        elif kind == "file":
            units += _UNIT * _file_part(part.get("file"))
    return units


def _tool_call(call: Mapping[str, Any]) -> int:
    fn = call.get("function")
    units = _UNIT * TOOL_CALL_OVERHEAD
    if isinstance(fn, Mapping):
        units += _text_units(_text(fn.get("name"))) + _text_units(_text(fn.get("arguments")))
    return units


# -- images, audio, files -------------------------------------------------------------------


def image_tokens(
    size: tuple[int, int] | None,
    *,
    detail: str = "auto",
    dialect: str = "openai",
    images: ImageRule = GPT_4O_IMAGES,
) -> int:
    """What one image costs by ``dialect``'s rule (OpenAI's: ``images``, the model's);
    ``size`` None (unknown) costs the most the rule allows. ``detail`` is OpenAI's:
    ``low`` is the rule's base alone, ``auto`` is taken as ``high`` (the model may
    choose it); the patch rule has no detail."""
    if _is_anthropic(dialect):
        if size is None:
            return ANTHROPIC_MAX_IMAGE_TOKENS
        w, h = (Fraction(max(1, side)) for side in size)
        scale = min(Fraction(1), Fraction(ANTHROPIC_LONG_EDGE_PX) / max(w, h))
        area = w * h * scale * scale
        return min(math.ceil(area / ANTHROPIC_PIXELS_PER_TOKEN), ANTHROPIC_MAX_IMAGE_TOKENS)
    if images.patches is not None:
        patches = MAX_PATCHES if size is None else _patches(*size)
        return math.ceil(patches * images.patches)
    if detail == "low":
        return images.base
    if size is None:  # at most 768 x 2048 once scaled: 2 x 4 tiles
        return images.base + images.tile * _tiles(Fraction(_SHORT_PX), Fraction(_FIT_PX))
    w, h = (Fraction(max(1, side)) for side in size)
    fit = min(Fraction(1), Fraction(_FIT_PX) / max(w, h))
    w, h = w * fit, h * fit
    short = min(Fraction(1), Fraction(_SHORT_PX) / min(w, h))
    return images.base + images.tile * _tiles(w * short, h * short)


def _patches(width: int, height: int) -> int:
    """The 32 px patches that cover an image, once one that needs more than 1,536 is
    scaled down to fit in them (OpenAI's steps: shrink by the square root of the
    ratio, then again so that a whole number of patches fits each side)."""
    w, h = max(1, width), max(1, height)
    whole = -(-w // _PATCH_PX) * -(-h // _PATCH_PX)
    if whole <= MAX_PATCHES:
        return whole
    shrink = math.sqrt(_PATCH_PX * _PATCH_PX * MAX_PATCHES / (w * h))
    across, down = w * shrink / _PATCH_PX, h * shrink / _PATCH_PX
    shrink *= min(math.floor(across) / across, math.floor(down) / down)
    w, h = int(w * shrink), int(h * shrink)  # whole pixels
    return min(MAX_PATCHES, -(-w // _PATCH_PX) * -(-h // _PATCH_PX))


def _tiles(width: Fraction, height: Fraction) -> int:
    return math.ceil(width / _TILE_PX) * math.ceil(height / _TILE_PX)


def _image_part(spec: object, dialect: str, images: Sequence[ImageRule]) -> int:
    """One image part, by the costliest of the ``images`` rules (Anthropic's own rule
    for its dialect)."""
    rules = images or (GPT_4O_IMAGES,)
    if not isinstance(spec, Mapping):
        return max(image_tokens(None, dialect=dialect, images=rule) for rule in rules)
    url, detail = spec.get("url"), spec.get("detail")
    detail = detail if isinstance(detail, str) else "auto"
    if detail == "low" and dialect != "anthropic" and all(r.patches is None for r in rules):
        return max(rule.base for rule in rules)  # no need to measure it
    size = media.image_size(url) if isinstance(url, str) else None
    return max(image_tokens(size, detail=detail, dialect=dialect, images=rule) for rule in rules)


def _audio_part(spec: object) -> int:
    if not isinstance(spec, Mapping) or not isinstance(spec.get("data"), str):
        return 0
    data, fmt = spec["data"], spec.get("format")
    fmt = fmt if isinstance(fmt, str) else ""
    seconds = media.audio_seconds(data, fmt)
    if seconds is None:
        size = media.decoded_size(data) or 0
        seconds = size / _LOWEST_BYTES_PER_SECOND.get(fmt, 1_000)
    return math.ceil(seconds * AUDIO_TOKENS_PER_SECOND)


def unsized(messages: Sequence[ChatMessage]) -> bool:
    """Whether a prompt holds content whose size callboard cannot know (a file sent by
    ``file_id``, counted as one page): its estimate then bounds nothing."""
    for m in messages:
        content = m.content
        if type(content) is str:
            continue
        for part in content if _is_array(content) else ():
            is_file = isinstance(part, Mapping) and part.get("type") == "file"
            if is_file and _file_data(part.get("file")) is None:
                return True
    return False


def _file_data(spec: object) -> str | None:
    """A file part's ``file_data`` (None: sent by ``file_id``, its size unknown to us)."""
    data = spec.get("file_data") if isinstance(spec, Mapping) else None
    return data if isinstance(data, str) else None


def _file_part(spec: object) -> int:
    data = _file_data(spec)
    if data is None:
        return PDF_PAGE_TOKENS  # by file_id: one page, its size unknown to us
    pages = media.pdf_pages(data)
    if pages is not None:
        return pages * PDF_PAGE_TOKENS
    return max(PDF_PAGE_TOKENS, ((media.decoded_size(data) or 0) + 3) // 4)  # bytes as text


# -- tools and response formats -------------------------------------------------------------


def _openai_function(fn: object) -> int:
    """The cookbook's count of one function definition (FUNC_END is the caller's)."""
    if not isinstance(fn, Mapping):
        return _UNIT * FUNC_INIT
    params = fn.get("parameters")
    props = params.get("properties") if isinstance(params, Mapping) else None
    return _UNIT * FUNC_INIT + _name_line(fn) + _openai_properties(props)


def _name_line(fn: Mapping[str, Any]) -> int:
    """``name:description`` (a final period dropped, as the cookbook does)."""
    return _text_units(_text(fn.get("name")) + ":" + _described(fn.get("description")))


def _openai_properties(props: object) -> int:
    """Properties, and the properties nested in them (of objects, and of arrays' items),
    each ``key:type:description`` by the cookbook's rule; walked with a stack, so a deep
    schema cannot exhaust the recursion limit."""
    units, stack = 0, [props]
    while stack:
        level = stack.pop()
        if not isinstance(level, Mapping) or not level:
            continue
        units += _UNIT * PROP_INIT
        for key, value in level.items():
            spec = value if isinstance(value, Mapping) else {}
            kind = spec.get("type")  # "string", or a union such as ["string", "null"]
            kinds = "|".join(map(_text, kind)) if _is_array(kind) else _text(kind)
            line = f"{_text(key)}:{kinds}:{_described(spec.get('description'))}"
            units += _UNIT * PROP_KEY + _text_units(line)
            enum = spec.get("enum")
            if _is_array(enum) and enum:
                units += _UNIT * ENUM_INIT
                units += sum(_UNIT * ENUM_ITEM + _text_units(_text(v)) for v in enum)
            items = spec.get("items")
            stack.append(spec.get("properties"))
            stack.append(items.get("properties") if isinstance(items, Mapping) else None)
    return units


def _anthropic_tool(tool: Mapping[str, Any]) -> int:
    """A tool as Anthropic receives it: name, description and input schema, as JSON text."""
    fn = tool.get("function")
    fn = fn if isinstance(fn, Mapping) else {}
    shape = {
        "name": fn.get("name"),
        "description": fn.get("description"),
        "input_schema": fn.get("parameters"),
    }
    return _text_units(_json_text(shape))


def _schema_tool(response_format: object) -> dict[str, Any] | None:
    """A ``json_schema`` response format as the tool it is counted as: its name and
    description, its schema standing as the parameters."""
    if not isinstance(response_format, Mapping) or response_format.get("type") != "json_schema":
        return None
    spec = response_format.get("json_schema")
    spec = spec if isinstance(spec, Mapping) else {}
    fields = {k: spec.get(k) for k in ("name", "description")}
    return {"type": "function", "function": {**fields, "parameters": spec.get("schema")}}


def _openai_schema(tool: Mapping[str, Any]) -> int:
    """A schema framed like one function definition: ``name:description`` by the
    cookbook's rule, the schema's JSON text as text."""
    fn = tool["function"]
    schema = _text_units(_json_text(fn.get("parameters")))
    return _UNIT * (FUNC_INIT + FUNC_END) + _name_line(fn) + schema


# -- JSON values as text --------------------------------------------------------------------

_MAX_NODES = 1_000_000
"""Values written when ``json.dumps`` cannot write a value (nested too deep, or a value
that refers to itself): a bound."""


def _text(value: object) -> str:
    """A value as text: a string as it is, null as nothing, the rest as JSON."""
    return value if isinstance(value, str) else "" if value is None else _json_text(value)


def _described(value: object) -> str:
    """A description as text, less a final period."""
    text = _text(value)
    return text[:-1] if isinstance(value, str) and text.endswith(".") else text


def _is_array(value: object) -> TypeGuard[Sequence[Any]]:
    """A JSON array: a list, or the tuple a frozen request holds it as."""
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _json_text(value: object) -> str:
    """``value``'s compact JSON text."""
    try:
        return _dumps(value)
    except (RecursionError, ValueError):  # nested past the recursion limit, or a cycle
        return _walked_json_text(value)


class _Literal:
    """Text ``_walked_json_text`` writes as it is (a bracket, a separator, a key)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _walked_json_text(value: object) -> str:
    """The same text, written with a stack (at most ``_MAX_NODES`` values)."""
    out: list[str] = []
    stack: list[object] = [value]
    for _ in range(_MAX_NODES):
        if not stack:
            break
        item = stack.pop()
        if isinstance(item, _Literal):
            out.append(item.text)
        elif isinstance(item, Mapping):
            stack.append(_Literal("}"))
            for i, (key, inner) in reversed(list(enumerate(item.items()))):
                stack.append(inner)
                name = key if isinstance(key, str) else _dumps(key)
                stack.append(_Literal(("," if i else "") + _dumps(name) + ":"))
            out.append("{")
        elif _is_array(item):
            stack.append(_Literal("]"))
            for i, inner in reversed(list(enumerate(item))):
                stack.append(inner)
                if i:
                    stack.append(_Literal(","))
            out.append("[")
        else:
            out.append(_dumps(item))
    return "".join(out)


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_thawed)


def _thawed(value: object) -> object:
    """What ``json.dumps`` writes for a value it does not know: a read-only mapping (how a
    frozen request holds an object) as a dict, anything else as its text."""
    return dict(value) if isinstance(value, Mapping) else str(value)
