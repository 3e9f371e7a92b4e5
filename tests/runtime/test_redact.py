"""Keeping secrets out of texts and log records (runtime/redact.py): every form of a
registered secret is hidden, in ``hide`` and in every record made afterwards, whoever
logs it; a record with no secret is left exactly as it was.

The registry is the process's own and only grows, so each test registers secrets of
its own (``fresh``) and never assumes one is unknown.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import string
import sys
import time
import urllib.parse
import uuid
from collections.abc import Iterator

import pytest
from callboard.core.secret import Secret
from callboard.runtime import redact
from callboard.runtime.redact import MIN_SECRET, RedactingFilter, Redactor, secrets_of
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from support import LogCollector, attached

MASK_ = "***"
BASE64_KEY = "sk-Ab3/Def+Ghi=jKL9xyz"


def fresh(prefix: str = "sk-test") -> str:
    """A secret no other test registered, with characters that quote differently."""
    return f"{prefix}/{uuid.uuid4().hex[:12]}+Q=="


def test_every_derived_form_of_a_secret_is_hidden() -> None:
    secret = fresh()
    r = Redactor([secret])
    raw = secret.encode()
    for text in (
        secret,
        repr(secret),
        repr(raw),
        json.dumps(secret),
        json.dumps(secret).replace("/", "\\/"),
        html.escape(secret),
        urllib.parse.quote(secret, safe=""),
        urllib.parse.quote(secret),
        urllib.parse.quote_plus(secret),
        base64.b64encode(raw).decode(),
        base64.b64encode(raw).decode().rstrip("="),
        base64.urlsafe_b64encode(raw).decode(),
    ):
        hidden = r.hide(f"before {text} after")
        assert hidden.startswith("before ")
        assert "***" in hidden
        assert secret[8:20] not in hidden, text


SPELLINGS = (
    lambda c: c,
    lambda c: "".join(f"%{b:02x}" for b in c.encode()),
    lambda c: "".join(f"%{b:02X}" for b in c.encode()),
    lambda c: "".join(f"%25{b:02X}" for b in c.encode()),  # a path escaped twice
    lambda c: f"\\u{ord(c):04x}",
    lambda c: f"\\u{ord(c):04X}",
    lambda c: "".join(f"\\x{b:02x}" for b in c.encode()),
    lambda c: f"&#{ord(c)};",
    lambda c: f"&#x{ord(c):x};",
    lambda c: f"&#X{ord(c):04X};",
    lambda c: "\\" + c,
    lambda c: "\\\\" + c,
)


@settings(deadline=None, max_examples=200)
@given(
    st.text(st.sampled_from("aZ09-_/+=.:'\"\\ é~"), min_size=2, max_size=10),
    st.lists(st.integers(0, len(SPELLINGS) - 1), min_size=30, max_size=30),
)
def test_a_secret_spelled_any_mix_of_ways_is_hidden(tail: str, ways: list[int]) -> None:
    """Servers quote a key in ways no list holds (.NET's lower-case percent escapes,
    Go's ``url.PathEscape`` leaving ``+`` and ``=``, Go's templates writing ``+`` as
    ``&#43;``, a repr inside JSON): each character in any of its spellings is still
    the key. (Letters and digits are written plain: no quoting escapes them, which is
    what lets a text without them skip the pass; JSON's ``\\u0041`` is undone before.)"""
    secret = "sk-Key0" + tail
    # a key ending in a backslash, written as an escape that starts with one (\u005c,
    # \x5c, \\), is there as it is, then the escape's rest: the key is hidden, and the
    # rest ("u005c") stays (found by hypothesis)
    last = SPELLINGS[ways[len(secret) - 1]]("\\")
    assume(not (secret.endswith("\\") and last.startswith("\\") and last != "\\"))
    written = "".join(
        c if c.isascii() and c.isalnum() else SPELLINGS[way](c)
        for way, c in zip(ways, secret, strict=False)
    )
    hidden = Redactor([secret]).hide(f"invalid api key {written}!")
    assert hidden == "invalid api key ***!", (written, hidden)


def test_a_key_decoded_as_a_form_value_or_named_html_references_is_hidden() -> None:
    secret = BASE64_KEY
    r = Redactor([secret])
    for written in (
        "sk-Ab3/Def Ghi=jKL9xyz",  # ``?key=`` decoded with its ``+`` as a space
        "sk-Ab3&sol;Def&plus;Ghi&equals;jKL9xyz",
        html.escape(secret, quote=False),
        json.dumps(repr(secret + "'")),  # a repr inside JSON (doubled backslashes)
    ):
        assert "Def" not in r.hide(f"[{written}]"), written


def test_a_key_dumped_in_hex_or_percent_escaped_byte_by_byte_is_hidden() -> None:
    """A server that echoes the bytes it got as hex, or every byte escaped (found by a
    hunt: the key reached the result's detail and the logs)."""
    raw = BASE64_KEY.encode()
    r = Redactor([BASE64_KEY])
    for written in (
        raw.hex(),
        raw.hex().upper(),
        "".join(f"%{b:02X}" for b in raw),
        "".join(f"%{b:02x}" for b in raw),
    ):
        assert r.hide(f"got {written}.") == "got ***.", written


def test_base64_holding_the_key_after_anything_else_hides_it() -> None:
    """A server that echoes a whole ``Authorization`` header encoded, or a key after
    any bytes: the key starts at any of three offsets of the Base64 groups."""
    secret = BASE64_KEY + "-0123456789"
    r = Redactor([secret])
    for before in ("", "B", "Be", "Bearer ", "Authorization: Bearer "):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            for after in ("", "!", "; and more"):
                written = encode(f"{before}{secret}{after}".encode()).decode()
                hidden = r.hide(written)
                assert MASK_ in hidden, (before, after)
                left = hidden.replace(MASK_, "")
                assert len(left) <= len(encode(f"{before}{after}".encode())) + 4, hidden


def test_a_spelled_key_is_found_around_its_letters_anywhere_in_a_long_text() -> None:
    """The spelled pass looks only near each place the key's letters are: a key spelled
    twice, far apart in a megabyte of text, is hidden in both places, the rest kept."""
    spelled = BASE64_KEY.replace("/", "%2f").replace("+", "&#43;")
    filler = "x" * 500_000
    text = f"{spelled}{filler}\\'{spelled}!{filler}jKL9xyz"
    hidden = Redactor([BASE64_KEY]).hide(text)
    assert hidden == f"***{filler}\\'***!{filler}jKL9xyz"


def test_a_long_run_of_escapes_is_read_in_linear_time() -> None:
    """The spelled pass is bounded: 200,000 backslashes after the key's letters end
    (the suite's timeout would catch a quadratic scan)."""
    text = "jKL9xyz " + "\\" * 200_000
    assert Redactor([BASE64_KEY]).hide(text) is text


def test_a_secret_spelled_with_json_escapes_is_hidden_and_the_json_still_parses() -> None:
    """A serialiser may escape any character (.NET writes ``+`` as ``\\u002B``, Gson
    ``=`` as ``\\u003d``): the echoed key is then none of its forms, yet parsing the
    JSON gives it back. Hidden, the text still parses, to the same JSON with the key
    masked; an escaped backslash before a ``u`` is not an escape."""
    secret = fresh()
    r = Redactor([secret])
    escaped = secret.replace("+", "\\u002B").replace("=", "\\u003d").replace("/", "\\u002f")
    note = "caf\\u00e9 \\\\u0041"
    body = '{"error": {"message": "bad key: ' + escaped + '", "note": "' + note + '"}}'
    assert json.loads(body)["error"]["message"] == f"bad key: {secret}"  # the leak
    hidden = r.hide(body)
    parsed = json.loads(hidden)
    assert parsed["error"]["message"] == "bad key: ***"
    assert parsed["error"]["note"] == "caf\u00e9 \\u0041"
    assert r.hide('{"a": "\\u002B\\u0041"}') == '{"a": "\\u002B\\u0041"}', "no secret: as it came"


SPELLED_SECRET = fresh("sk-spelled")
SPELLED = (
    f"you sent: {SPELLED_SECRET} (and {SPELLED_SECRET[:5]}, which is not it), {SPELLED_SECRET}!"
)


@settings(deadline=None, max_examples=200)
@given(st.lists(st.integers(0, len(SPELLED)), max_size=12))
def test_a_secret_spelled_across_a_streams_pieces_never_reaches_the_reader(
    cuts: list[int],
) -> None:
    """However the stream's text is cut into pieces, what ``SpelledGuard`` lets go,
    piece by piece, then what it held at the end, is the whole text hidden, but for at
    most ``SHOWN_AT_MOST`` characters of a secret's beginning before its mask."""
    redact.register([SPELLED_SECRET])
    guard = redact.SpelledGuard()
    at, out = 0, []
    for cut in [*sorted(cuts), len(SPELLED)]:
        out.append(guard.through("content", SPELLED[at:cut]))
        at = cut
    out.append(guard.rest("content"))
    joined = "".join(out)
    for shown in range(redact.SHOWN_AT_MOST, 0, -1):
        joined = joined.replace(SPELLED_SECRET[:shown] + "***", "***")
    assert joined == redact.hide(SPELLED)
    assert joined.count("***") == 2
    assert guard.held() == []


CASED_SECRET = fresh("sk-cased-0123456789")
"""One secret for every example: a fresh one each registered 100 secrets with the
process, whose every later stream then scanned a thousand forms a delta (a
3,000-delta test after it took 54 s instead of 2)."""


@settings(deadline=None, max_examples=100)
@given(st.lists(st.integers(0, 80), max_size=8))
def test_a_key_a_stream_spells_in_another_case_is_hidden_from_its_reader(
    cuts: list[int],
) -> None:
    """An upper-cased key went to a stream's reader whole (only the final answer was
    hidden; a review)."""
    secret = CASED_SECRET
    redact.register([secret])
    text = f"your key is {secret.upper()} ok"
    guard = redact.SpelledGuard()
    at, out = 0, []
    for cut in [*sorted(c for c in cuts if c < len(text)), len(text)]:
        out.append(guard.through("content", text[at:cut]))
        at = cut
    out.append(guard.rest("content"))
    joined = "".join(out)
    assert secret.upper()[redact.SHOWN_AT_MOST :] not in joined
    assert joined.endswith("*** ok"), joined
    assert guard.hid


def test_what_begins_a_secret_is_held_until_the_text_says_otherwise() -> None:
    secret = fresh("sk-held")
    redact.register([secret])
    guard = redact.SpelledGuard()
    assert guard.through(0, "key: " + secret[:4]) == "key: "
    assert guard.through(1, "other text") == "other text"  # texts are apart
    assert guard.through(0, "!") == ""  # any character but white space goes on with it
    assert guard.through(0, "\n") == secret[:4] + "!\n"  # white space: not the secret
    assert guard.through(0, secret[:-1]) == ""
    assert guard.rest(0) == secret[:-1]  # the text ended: no secret in it
    escaped = secret[:3] + "".join(f"\\u{ord(c):04x}" for c in secret[3:6]) + secret[6:]
    assert guard.through(3, '{"k":"') == '{"k":"'  # tool-call arguments, a JSON text
    assert guard.through(3, escaped + '"}') == '***"}'  # escaped for JSON: hidden too
    assert guard.through(2, "cats and sk") == "cats and sk"  # no more than SHOWN_AT_MOST
    assert guard.through(2, secret[2:] + ".") == "***."  # what was shown, then the mask


@pytest.mark.parametrize("first", ["\u017f", "S"])  # a long s: re.IGNORECASE reads it as s
def test_a_secret_begun_in_another_case_is_held_from_its_head(first: str) -> None:
    """A key spelled in a case the loose search reads as the key (a long s for its
    ``s``) is masked once whole; until then the stream holds it from its head too, so
    a reader sees no more of it than ``SHOWN_AT_MOST`` characters. Before, ``begun``
    lower-cased each head alone (``\u017f``.lower() is itself) and let go of the
    beginning a piece at a time (found comparing it with its regular expression)."""
    secret = fresh("sk-case")
    redact.register([secret])
    guard = redact.SpelledGuard()
    assert guard.through(0, "key: " + first + secret[1:9]) == "key: "
    assert guard.through(0, secret[9:] + " ok") == "*** ok"
    assert guard.hid


def test_what_a_stream_holds_back_tells_nothing_of_a_secret_past_its_first_characters() -> None:
    """The guard held back what began a secret and let go what did not: a gateway
    client that had the model echo ``sk-a``, ``sk-b``... as pieces of their own saw
    which guess was held, and had the key one character a request (found by a hunt:
    24 requests for a 24-character key). Now every guess is held alike."""
    secret = fresh("sk-oracle")
    redact.register([secret])
    for known in range(redact.HEAD, len(secret) - 1):
        seen = set()
        for guess in string.ascii_letters + string.digits:
            guard = redact.SpelledGuard()
            first = guard.through(0, "\n" + secret[:known] + guess)
            then = guard.through(0, "\n")
            seen.add((len(first), len(then)))
        assert len(seen) == 1, (known, seen)


def test_where_a_held_text_is_let_go_tells_nothing_of_the_characters_a_secret_holds() -> None:
    """The run a held text went on with was made of the characters the secrets' forms
    hold: a client that echoed ``sk-abc`` and then a probe character learned which
    unusual characters a key held (found by a review). Only white space ends it."""
    secret = fresh("sk-pw#!")
    redact.register([secret])
    seen = set()
    for probe in "!#%&;\\@-_=":
        guard = redact.SpelledGuard()
        first = guard.through(0, "\n" + secret[:5] + probe)
        seen.add((len(first), len(guard.through(0, "\n"))))
    assert len(seen) == 1, seen


@pytest.mark.parametrize("cut", range(1, 12))
def test_a_key_escaped_for_json_and_cut_inside_an_escape_is_hidden(cut: int) -> None:
    """A ``\\u00XX`` escape cut between two pieces went out half in each, unescaped in
    neither: the reader's JSON held the key (found by a review)."""
    secret = fresh("sk-esc")
    redact.register([secret])
    escaped = '{"k":"' + "".join(f"\\u{ord(c):04x}" for c in secret[:3]) + secret[3:] + '"}'
    guard = redact.SpelledGuard()
    shown = guard.through(0, escaped[:cut]) + guard.through(0, escaped[cut:]) + guard.rest(0)
    assert secret not in json.loads(shown.replace("***", "x"))["k"]
    assert json.loads(shown)["k"].endswith("***")


def test_an_escape_left_open_at_a_pieces_end_is_found_in_time_linear_in_its_backslashes() -> None:
    """An escape is held only when its own backslash is not escaped; a hostile stream's
    run of backslashes costs one pass, not one a position."""
    assert [redact._open_escape(t) for t in ("a\\", "a\\u00", "a\\u0073", "a\\\\")] == [1, 4, 0, 0]
    started = time.process_time()
    assert redact._open_escape("\\" * 200_000 + "u") == 0  # escaped: the u is text
    assert time.process_time() - started < 1.0


def test_basic_credentials_are_hidden_as_base64_of_user_and_password() -> None:
    password = fresh("pw")
    url = f"http://hunter:{urllib.parse.quote(password, safe='')}@proxy:3128"
    r = Redactor(secrets_of(urls=[url]))
    header = base64.b64encode(f"hunter:{password}".encode()).decode()
    for text in (f"Proxy-Authorization: Basic {header}", header.rstrip("="), password):
        assert header.rstrip("=") not in r.hide(text)
        assert password not in r.hide(text)


def test_a_key_quoted_as_a_repr_or_bytes_repr_is_hidden() -> None:
    # ModelSettings refuses such a key (ConfigError); the redactor, the last line of
    # defence, still hides one that came some other way
    secret = "sk-hunt-0123456789abcdefghijKLMNOPQRSTUV"  # noqa: S105 - a fake key
    key = secret + "\r"
    r = Redactor([key])
    for text in (
        f"raw {key} end",
        f"Illegal header value b'Bearer {key.encode()!r}'",
        f"repr {key!r}",
        "E" * 290 + key,
    ):
        assert secret[:8] not in r.hide(text), text


@pytest.mark.parametrize(
    "echoed",
    [
        "{head}\n{tail}",
        "{head}\r\n        {tail}",
        "{head}\\n{tail}",  # in a JSON text, escaped
        "{upper}",
        "{head}\n{middle}\n{end}",  # wrapped twice
    ],
)
def test_a_key_broken_by_line_breaks_or_in_another_case_is_hidden(echoed: str) -> None:
    """A server wrapping its text broke an echoed key with a line break, or upper-cased
    it, and the key went through to a gateway's client (found by a hunt)."""
    secret = "sk-proj-AbCdEf0123456789GhIjKlMnOpQr"  # noqa: S105 - a fake key
    text = "bad key " + echoed.format(
        head=secret[:14],
        tail=secret[14:],
        middle=secret[14:24],
        end=secret[24:],
        upper=secret.upper(),
    )
    hidden = Redactor([secret]).hide(text)
    assert hidden == "bad key ***", hidden


@pytest.mark.parametrize("separator", ["\u2028", "\x0b", "\x0c", "\x85", "\t"])
def test_a_key_broken_by_any_separator_is_hidden(separator: str) -> None:
    secret = "sk-proj-AbCdEf0123456789GhIjKlMnOpQr"  # noqa: S105 - a fake key
    assert Redactor([secret]).hide(f"k {secret[:9]}{separator}{secret[9:]}") == "k ***"


def test_a_key_broken_in_each_of_its_pieces_but_one_is_hidden() -> None:
    """Eight pieces, whatever its length: seven breaks leave one whole (a 57-character
    key was cut in seven pieces and a last of one character, dropped; a review)."""
    secret = "sk-" + "e298cidP8OP4M9gdPxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567"  # 57
    assert len(secret) == 57
    size = len(secret) // 8
    pieces = [secret[k * size : (k + 1) * size] for k in range(7)] + [secret[7 * size :]]
    broken = "".join(p[:3] + "\n" + p[3:] for p in pieces[:7]) + pieces[7]  # 7 breaks
    assert Redactor([secret]).hide(broken) == "***"


def test_a_short_secret_is_matched_exactly_only() -> None:
    """Loosely, a URL's six-letter password masked ordinary words (a review)."""
    r = Redactor(["Summer"])
    text = "summer sale ends; the sum mer of 69"
    assert r.hide(text) is text
    assert r.hide("pass Summer!") == "pass ***!"


def test_the_loose_match_masks_only_the_whole_secret() -> None:
    secret = "sk-proj-AbCdEf0123456789GhIjKlMnOpQr"  # noqa: S105 - a fake key
    r = Redactor([secret])
    near = "sk-proj-AbCdEf 0123456789 and more text mentioning 0123 and ghij"
    assert r.hide(near) is near  # pieces of it, never the whole: left as it came
    assert r.hide("Ünïcödé " + secret.upper()) == "Ünïcödé ***"


def test_a_secret_inside_another_leaves_nothing_of_the_longer_one() -> None:
    short = fresh()
    longer = short + "-TAIL-of-the-longer-one"
    assert "TAIL" not in Redactor([short, longer]).hide(f"x {longer} y")


GATE_SECRETS = (
    BASE64_KEY,
    "sk-proj-Qm9vLWJhcg_xYz-0123456789abcdefGHIJ",
    "user:pa55/w+rd=more",
    "Ünïcödé-key-0123456789",
    "tok-ab***cd-0123456789",
    "ABCDEFGH",
)
GATE_WORDS = (
    *(form for secret in GATE_SECRETS for form in sorted(redact.forms(secret))),
    *GATE_SECRETS,
    "The quick brown fox",
    " ",
    "\n  ",
    "%",
    "\\u0041",
    "***",
    "Ab3",
)


@settings(deadline=None, max_examples=300)
@given(
    st.lists(
        st.tuples(st.sampled_from(GATE_WORDS), st.booleans(), st.integers(0, 3)),
        max_size=8,
    ),
    st.integers(0, 40),
)
def test_a_redactor_that_gates_its_search_hides_exactly_what_one_searching_everything_does(
    pieces: list[tuple[str, bool, int]], start: int
) -> None:
    text = ""
    for word, upper, cut in pieces:  # forms whole, in another case, cut short, side by side
        cased = word.upper() if upper else word
        text += cased[: len(cased) - cut] if cut < len(cased) else cased
    searching, gated = Redactor(GATE_SECRETS, gated=False), Redactor(GATE_SECRETS, gated=True)
    assert gated.hide(text) == searching.hide(text)
    start = min(start, len(text))
    assert gated.hide_after(text, start) == searching.hide_after(text, start)


def test_a_secret_that_masking_another_spells_is_hidden_by_a_gated_redactor() -> None:
    outer, inner = "tok-ab***cd-0123456789", "QQQQ-inner-QQQQ"
    text = f"x tok-ab{inner}cd-0123456789 y"  # outer appears once inner is masked
    for gated in (False, True):
        assert Redactor([outer, inner], gated=gated).hide(text) == "x *** y"


def test_every_form_of_each_of_many_secrets_is_hidden() -> None:
    many = [f"sk-many-{i:04d}-{uuid.uuid4().hex}" for i in range(200)]
    r = Redactor(many)
    for secret in many[::20]:
        for form in redact.forms(secret):
            hidden = r.hide(f"said {form} there")
            assert hidden.startswith("said "), form
            assert hidden.endswith(" there"), form
            assert MASK_ in hidden, form
            assert form not in hidden, form
        assert r.hide(f"said {secret.upper()} there") == "said *** there"
        assert r.hide_after(f"x {secret[:20]}\n  {secret[20:]}", 1) == " ***"


LOOSE_SECRETS = ("tok-live-0123456789abcdefXYZ", "sk-proj-AbCdEf0123456789xyzIKS")
GAPS = (" ", "\n", "\t", "\r\n", "\\n", "\\T", "\x0b", "\x85", "\u2028")
ODD_CASES = {"s": "\u017f", "k": "\u212a", "i": "\u0131", "I": "\u0130"}
"""Characters that match a letter in any case and lower-case to another (``re.I``)."""


@settings(deadline=None, max_examples=300)
@given(
    st.sampled_from(LOOSE_SECRETS),
    st.lists(st.integers(0, 3), max_size=30),
    st.dictionaries(
        st.integers(0, 26),
        st.lists(st.sampled_from(GAPS), min_size=1, max_size=2),
        max_size=redact.LOOSE_PIECES - 1,
    ),
    st.booleans(),
    st.booleans(),
)
def test_a_key_spelled_loosely_in_any_case_is_hidden_whatever_stands_before_it(
    secret: str, cases: list[int], gaps: dict[int, list[str]], escaped: bool, gated: bool
) -> None:
    """Broken by white space and JSON's escapes (at most ``LOOSE_PIECES - 1`` times), in
    any case (those that lower-case to another letter too), a backslash before it:
    masked whole, what is around it kept."""
    spelled = ""
    for i, char in enumerate(secret):
        case = cases[i] if i < len(cases) else 0
        spelled += (char, char.swapcase(), ODD_CASES.get(char, char), char.upper())[case]
        if i < len(secret) - 1:
            spelled += "".join(gaps.get(i, ()))
    before = "<<\\" if escaped else "<< "
    text = f"{before}{spelled} >>"
    assert Redactor([secret], gated=gated).hide(text) == f"{before}*** >>"


def test_a_text_repeating_the_public_start_of_many_keys_costs_one_look_not_one_a_key() -> None:
    """A text that holds a piece of a key, its public start (``sk-proj``), 200,000 times
    is looked at loosely only for a key whose other characters it holds: before that,
    100 keys held the loop 23 s. A broken key in it is still hidden."""
    keys = [f"sk-proj-{uuid.uuid4().hex}{i:03d}" for i in range(100)]
    r = Redactor(keys)
    text = "sk-proj " * 200_000
    started = time.process_time()
    assert r.hide(text) is text
    assert time.process_time() - started < 5.0  # ~0.1 s; the suite's timeout would catch 23
    broken = f"{text}{keys[7][:20].upper()}\n   {keys[7][20:]} end"
    assert r.hide(broken) == f"{text}*** end"


def test_a_text_with_no_secret_is_returned_as_it_came() -> None:
    text = "nothing to see here " * 3
    assert Redactor([fresh()]).hide(text) is text


def test_a_secret_shorter_than_the_minimum_is_not_hidden() -> None:
    short = "x" * (MIN_SECRET - 1)
    assert not Redactor([short])
    assert Redactor([short]).hide(f"a {short} b") == f"a {short} b"


def test_hide_cut_hides_before_it_cuts() -> None:
    secret = fresh()
    redact.register([secret])
    text = "E" * 290 + secret
    assert redact.hide_cut(text, 300) == "E" * 290 + "***"


def test_secrets_of_takes_a_key_whole_and_a_url_by_its_secret_parts() -> None:
    key = fresh()
    assert secrets_of(Secret(key), None) == {key}
    assert secrets_of(urls=["https://api.example/v1?api-version=1"]) == set()
    assert secrets_of(urls=[f"https://h/v1?key={key}"]) >= {key}
    token = f"bot{uuid.uuid4().hex}"
    whole = f"https://h/{token}/v1"
    found = secrets_of(urls=[Secret(whole)])  # declared secret, no part known: whole,
    assert found == {whole, token}  # and the token a server may echo alone


def test_the_names_in_a_secret_url_stay_readable_in_answers_and_logs() -> None:
    """Its whole path and long segments registered, a model's answer naming the
    deployment or the API's path came back as ``***`` (a review)."""
    url = "https://x.openai.azure.com/openai/deployments/gpt-4o-mini-2024-07-18"
    r = Redactor(secrets_of(urls=[Secret(url)]))
    said = "use gpt-4o-mini-2024-07-18 at /openai/deployments"
    assert r.hide(said) == said
    assert r.hide(f"at {url}") == "at ***", "the URL itself is the secret"


def test_a_token_in_a_secret_urls_path_is_hidden_where_a_server_echoes_the_path() -> None:
    """Express's 404 says ``Cannot POST /<path>``: with the URL registered whole only,
    the token reached results, logs and the gateway's clients (found by a hunt)."""
    token = f"tok{uuid.uuid4().hex}"
    r = Redactor(secrets_of(urls=[Secret(f"https://h.example/{token}/v1")]))
    said = r.hide(f"Cannot POST /{token}/v1/chat/completions")
    assert token not in said
    assert said.endswith("/chat/completions")
    assert r.hide("the deployments of v1") == "the deployments of v1", "words stay"


# -- log records ------------------------------------------------------------------


@pytest.fixture
def logs() -> Iterator[LogCollector]:
    collector = LogCollector()
    with attached(collector, "callboard.test_redact", "httpcore.test_redact", level=logging.DEBUG):
        yield collector


def test_a_record_made_after_registration_is_redacted_whoever_logs_it(logs: LogCollector) -> None:
    secret = fresh()
    redact.register([secret])
    logging.getLogger("httpcore.test_redact").debug(
        "send_request_headers.started headers=%r", [(b"authorization", f"Bearer {secret}".encode())]
    )
    logging.getLogger("callboard.test_redact").info("key %s in %s", secret, "args")
    (lib, ours) = logs.records
    assert secret not in lib.getMessage()
    assert "***" in lib.getMessage()
    assert ours.getMessage() == "key *** in args"
    logs.assert_no_secret(secret)


def test_a_traceback_and_a_stack_are_redacted(logs: LogCollector) -> None:
    secret = fresh()
    redact.register([secret])
    log = logging.getLogger("callboard.test_redact")

    def send() -> None:
        raise ValueError(f"bad header {secret!r}")

    try:
        send()
    except ValueError:
        log.exception("failed")
    log.warning("here", stack_info=True, extra={"where": secret})
    logs.assert_no_secret(secret)
    assert "ValueError: bad header '***'" in logs.lines[0]


def test_extra_fields_and_the_exception_object_are_redacted_too(logs: LogCollector) -> None:
    """Review: a handler that formats ``exc_info`` again (Sentry-style) or dumps
    ``extra=`` fields (JSON logs) saw the secret. The first is redacted for every
    record; the second by ``RedactingFilter`` (the CLI's handler has it)."""
    secret = fresh()
    redact.register([secret])
    log = logging.getLogger("callboard.test_redact")

    def send() -> None:
        raise ValueError(f"bad {secret}")

    try:
        send()
    except ValueError:
        log.exception("failed", extra={"url": f"https://h/v1?key={secret}", "n": 3})
    record = logs.records[-1]
    assert record.exc_info is None
    assert record.exc_text is not None
    assert "***" in record.exc_text
    # ``extra=`` is set on a record after the factory made it: a handler's filter sees it
    assert RedactingFilter().filter(record)
    assert secret not in record.url
    assert record.n == 3


def test_extra_fields_in_dicts_and_lists_are_redacted_by_the_filter(logs: LogCollector) -> None:
    """A JSON formatter prints ``extra={"headers": {...}}`` whole: only texts directly
    in a field were hidden (found by a hunt)."""
    secret = fresh()
    redact.register([secret])
    headers = {"authorization": f"Bearer {secret}", "accept": "json"}
    logging.getLogger("callboard.test_redact").info(
        "sent", extra={"headers": headers, "seen": [("key", secret)], "n": 3}
    )
    record = logs.records[-1]
    assert RedactingFilter().filter(record)
    assert record.headers == {"authorization": "Bearer ***", "accept": "json"}
    assert record.seen == [("key", "***")]
    assert record.n == 3
    assert headers["authorization"] == f"Bearer {secret}"  # the caller's own, untouched


def test_a_message_that_is_a_dict_keeps_its_shape(logs: LogCollector) -> None:
    """structlog's bridge to logging puts its event dict in ``msg``, and its formatter
    copies it: made a str, every record that named a key was lost to an
    ``AttributeError`` (found by a hunt). Its texts are hidden, the dict kept."""
    secret = fresh()
    redact.register([secret])
    log = logging.getLogger("callboard.test_redact")
    log.warning({"event": f"calling with {secret}", "attempt": 2})
    log.warning({"event": "nothing to hide"})
    hidden, plain = logs.records[-2:]
    assert hidden.msg == {"event": "calling with ***", "attempt": 2}
    assert plain.msg == {"event": "nothing to hide"}


def test_a_dict_message_whose_secret_is_outside_its_texts_is_hidden_whole(
    logs: LogCollector,
) -> None:
    """Its shape is kept only where its texts hold every secret: an exception's words,
    bytes or a key in it showed the key, and a dict holding itself raised
    ``RecursionError`` to whoever logged it (a review)."""
    secret = fresh()
    redact.register([secret])
    log = logging.getLogger("callboard.test_redact")
    looped: dict[str, object] = {"event": "loop"}
    looped["self"] = looped
    log.warning({"error": ValueError(f"bad key {secret}"), "raw": secret.encode()})
    log.warning(looped)
    log.warning({secret: 1})
    outside, loop, keyed = logs.records[-3:]
    for record in (outside, keyed):
        assert secret not in str(record.msg)
        assert "***" in str(record.msg)
    assert loop.msg is looped  # nothing to hide: as it was, and logged
    logs.assert_no_secret(secret)


def test_a_record_with_no_secret_is_left_as_it_was(logs: LogCollector) -> None:
    redact.register([fresh()])
    args = ("actor", 3)
    logging.getLogger("callboard.test_redact").warning("%s #%d crashed", *args)
    (record,) = logs.records
    assert record.msg == "%s #%d crashed"
    assert record.args == args


def test_a_record_that_cannot_format_is_left_to_its_handler() -> None:
    redact.register([fresh()])
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "%d", ("not a number",), None)
    redact.redact_record(record)
    assert record.args == ("not a number",)


def test_the_filter_redacts_a_record_made_before_its_secret_was_known() -> None:
    secret = fresh()
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "key=%s", (secret,), None)
    redact.register([secret])
    assert RedactingFilter().filter(record)
    assert record.getMessage() == "key=***"
    assert record.args == ()


def test_registration_installs_the_record_factory_once() -> None:
    redact.register([fresh()])
    factory = logging.getLogRecordFactory()
    redact.register([fresh()])
    assert logging.getLogRecordFactory() is factory
    record = factory("x", logging.INFO, __file__, 1, "m", None, sys.exc_info())
    assert record.getMessage() == "m"


@given(st.text(alphabet="ab\\nrtfvu \t\r\n\x00\x1c\x1f\x7f", max_size=60))
def test_an_ascii_text_is_squeezed_as_the_one_expression_squeezes_it(text: str) -> None:
    """The two passes that squeeze an ASCII text (its escapes, then its characters) take
    out what ``_GAP_ITEM`` takes out in one (they cost 0.7 ms of a 364 KB answer where
    it cost 6.5)."""
    assert redact._squeezed(text) == redact._GAP_ITEM.sub("", text)


@given(st.lists(st.sampled_from(["sk-", "bench", "-0123", "y", " ", "456789", "\n"]), max_size=30))
def test_a_short_text_is_said_to_hold_a_needle_as_a_long_one_is(parts: list[str]) -> None:
    """A text shorter than ``SMALL_TEXT`` is searched with ``in`` (the automaton lets go
    of the interpreter's lock); it is found to hold a needle exactly when the same text,
    made long, is."""
    r = Redactor(["sk-bench-0123456789abcdef"], gated=False)
    gate = r._gate
    assert gate is not None
    text = "".join(parts)[: redact.SMALL_TEXT - 1]
    assert gate.holds_none(text) == gate.holds_none(text + " " * redact.SMALL_TEXT)


def test_a_loose_secret_begun_with_a_dotted_capital_i_is_held_from_its_head() -> None:
    """``"\\u0130".lower()`` is two characters, so a head made only of the secret's
    lower case was never in a text that spells the key as it is (found by a review)."""
    secret = "\u0130" + fresh("abc")
    redact.register([secret])
    guard = redact.SpelledGuard()
    assert guard.through(0, "here: " + secret[:3].upper()) == "here: "
    assert guard.through(0, secret[3:].upper() + " done") == "*** done"


def test_what_a_stream_holds_back_is_found_in_time_linear_in_the_window() -> None:
    """Repeated heads ending in white space, as long as the longest form allows: one
    expression reading on from each head to the next break cost 35 ms a delta at a
    JWT's length (found by a review); the run is found first now."""
    secret = "eyJ" + "a" * 1000
    r = Redactor([secret])
    text = "eyJ" * 900 + " "
    started = time.process_time()
    for _ in range(100):
        assert r.begun(text) == 0
    assert time.process_time() - started < 1.0  # ~0.3 ms; quadratic, 3.5 s


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("size", [10, 1000])
def test_a_text_with_a_lone_surrogate_is_hidden_and_raises_nothing(gated: bool, size: int) -> None:
    """JSON's ``"\\ud800"``, parsed, is a lone surrogate, which the gate's automaton
    (UTF-8) cannot read: it raised out of ``hide`` (found by a review)."""
    secret = fresh("sk-surrogate")
    r = Redactor([secret, fresh("sk-other"), fresh("sk-third")], gated=gated)
    text = "x" * size + "\ud800 " + secret + " " + secret.upper()
    assert r.hide(text) == "x" * size + "\ud800 *** ***"
    assert r.hide_after(text, 0).count("***") == 2


def test_a_log_record_with_a_lone_surrogate_is_made_and_hidden() -> None:
    """Once a secret is registered every record the process makes is redacted: one
    holding a lone surrogate raised ``UnicodeEncodeError`` out of the host's own log
    call (found by a review)."""
    secret = fresh("sk-logged")
    redact.register([secret])
    record = logging.makeLogRecord({"msg": "bad %s", "args": ("x" * 300 + "\ud800 " + secret,)})
    redact.redact_record(record)
    assert record.getMessage() == "bad " + "x" * 300 + "\ud800 ***"


def test_a_redactor_of_many_secrets_is_built_again_without_compiling_them_again() -> None:
    """A registration rebuilds the redactor of every secret: a cache of the last 256
    compiled missed every one past 256, and a 501st key took 7 s to register (a host
    making a system for each customer's key; found by a hunt)."""
    keys = frozenset(fresh("sk-cust") for _ in range(300))
    Redactor(keys)
    compiled, loose = redact._compiled.cache_info(), redact._loose.cache_info()
    more = Redactor(keys | {fresh("sk-cust")})
    assert redact._compiled.cache_info().misses == compiled.misses + 1
    assert redact._loose.cache_info().misses == loose.misses + 1
    assert more.hide(f"said {next(iter(keys))}") == f"said {MASK_}"
