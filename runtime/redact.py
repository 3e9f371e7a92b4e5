"""Keeping secrets out of everything callboard lets go: error details, results, logs.

Every secret the HTTP layer sends (an API key; a proxy's or a base URL's
credentials; a base URL's key-like query values: ``core/secret.py`` says
which) is registered here when its model's transport or client is made, before
anything is sent. From then on ``hide`` replaces it with ``***`` in every form
we can derive (``forms``):

- as is, as a Python repr and a bytes repr (an error about a header quotes
  ``b'Bearer ...'``), JSON-escaped (also with ``/`` as ``\\/``, as PHP and some
  Java serialisers write it), HTML-escaped, URL-quoted (every character; ``/``
  kept; ``+`` for spaces);
- Base64, standard and URL-safe, at each of the three offsets a secret may
  start at inside a longer encoded text (a Basic ``Authorization`` header's
  ``user:password``, registered whole for this; a whole ``Bearer <key>``
  header a server echoes encoded): the characters fixed by the secret alone,
  so at most the bits of its first and last byte stay outside the mask.

A server may quote a key in ways no list can hold (lower-case percent escapes,
percent escapes applied twice (a URL inside a URL), some characters escaped and
not others, ``&#43;`` for ``+``, a ``+`` decoded as a space, a repr inside JSON):
``spelled`` matches a secret written
with any mix of them, character by character (``_spellings``). That pass runs
only on a text holding the secret's longest run of letters and digits (no such
quoting touches those), so a text without the key costs a substring test.

A server that wraps its text may break a key it echoes with line breaks (and
indent what follows), or write it in another case: ``hide`` also masks the
secret of ``LOOSE_MIN`` characters or more in any case with a little white
space or control characters (or a JSON ``\\n``) between any two of its
characters (``_loose``), looked for only where a text holds one of its pieces
whole in any case (``_pieces``), so a text without one costs a ``lower()`` and a
few substring tests; and, for a key of ASCII characters, only if the text with all
such white space taken out holds the key but for its first character
(``_squeezed``): a piece may be public (``sk-proj``), and a text repeating it
200,000 times made each registered key's pattern scan the whole text (100 keys: 23 s
of the loop; found by a review). A stream's guard (``SpelledGuard``) masks it in any case
too, and holds back from where one may begin in any case; but it lets a text go
at white space no form holds, so a key a stream breaks with white space shows
what came before the break.

The gate: every text is first read in one Aho-Corasick pass (``_Gate``) that says
whether any form, anchor or piece may be in it (most texts: none, and that is all
they cost) and, for a redactor of more than about three secrets (``GATED_FROM``),
which, so only those are looked for: a text then costs what its length does, not
what the number of registered secrets does. The gate only skips what cannot be in
the text, so the answers are the same either way.

Log records: the first registration chains ``redact_record`` into logging's
record factory, so a record made anywhere in the process (callboard, httpx,
aiohttp, asyncio...) is redacted before any handler sees it.
``RedactingFilter`` does the same on callboard's own handlers (the CLI's), in
case someone replaces the factory without chaining ours.

What must hold: after ``register(s)``, no text through ``hide`` and no log
record made afterwards (message, traceback, stack) contains a form of ``s``, nor
its ``extra=`` fields at a handler with ``RedactingFilter`` (they are set after the
factory: the docs said every record's were hidden; found by a hunt); a record that
holds no secret is left exactly as it was.
Registration only adds: a secret stays hidden for the life of the process, so
the set is bounded by the secrets the process was configured with. Secrets
shorter than ``MIN_SECRET`` characters are not hidden: they would mask ordinary
words in every text.
"""

from __future__ import annotations

import base64
import functools
import html
import html.entities
import itertools
import json
import logging
import re
import string
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import ahocorasick_rs
from callboard.core.secret import MASK, Secret, reveal, unmarked_secrets, url_secrets

MIN_SECRET: Final = 6
"""Shorter secrets are not hidden (see the module)."""


def forms(secret: str) -> set[str]:
    """``secret`` as is and as the texts that may quote or encode it (see the module)."""
    as_json = json.dumps(secret)[1:-1]
    raw = secret.encode("utf-8", "replace")
    quoted = {
        secret,
        repr(secret)[1:-1],
        repr(raw)[2:-1],
        as_json,
        as_json.replace("/", "\\/"),
        json.dumps(secret, ensure_ascii=False)[1:-1],
        html.escape(secret),
        urllib.parse.quote(secret, safe=""),
        urllib.parse.quote(secret),
        urllib.parse.quote_plus(secret),
    }
    if "+" in secret:  # a query value's ``+`` decoded as a space, echoed so
        quoted.add(secret.replace("+", " "))
    hexed = raw.hex()  # a server's dump of the bytes, and every byte percent-escaped
    quoted |= {hexed, hexed.upper(), "".join(f"%{b:02X}" for b in raw)}
    quoted.add("".join(f"%{b:02x}" for b in raw))
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        encoded = encode(raw).decode("ascii")
        quoted |= {encoded, encoded.rstrip("=")}
        for offset in (1, 2):  # after 1 or 2 bytes of something else (``Bearer ``)
            shifted = encode(bytes(offset) + raw).decode("ascii")
            fixed = shifted[(8 * offset + 5) // 6 : 8 * (offset + len(raw)) // 6]
            quoted.add(fixed)  # the characters no byte around the secret changes
        quoted.add(encoded[: 8 * len(raw) // 6])  # offset 0, something after it
    return quoted


_BACKSLASHES = r"(?:\\){0,4}"
"""The escaping a character may carry, a few levels deep (a repr's ``\'`` inside JSON
is ``\\'``); bounded, so a run of backslashes costs linear time."""


def _either_case(value: int, width: int = 0) -> str:
    """A regex for ``value`` in hexadecimal, either case, zero-padded to ``width``."""
    digits = f"{value:0{width}x}"
    return "".join(f"[{d}{d.upper()}]" if d.isalpha() else d for d in digits)


def _spellings(char: str, *, first: bool = False) -> str:
    """A regex for ``char`` as a text may write it: plain, percent-escaped (either
    case, once or twice), JSON or Python escaped (``\\u002b``, ``\\x2b``, ``\\'``), as an HTML
    character reference, by number or by name; a ``+`` as a space (form decoding).
    The ``first`` character takes no escaping backslashes (they would stay outside
    the mask, harmless), so the regex engine can skip to where one of its spellings
    begins."""
    code = ord(char)
    data = char.encode("utf-8", "replace")
    ways = {
        re.escape(char),
        "".join("%" + _either_case(b, 2) for b in data),
        "".join("%25" + _either_case(b, 2) for b in data),  # escaped twice (a URL in a URL)
        "".join(r"\\x" + _either_case(b, 2) for b in data),
        f"&#0{{0,6}}{code};",
        f"&#[xX]0{{0,6}}{_either_case(code)};",
    }
    if code < 0x10000:
        ways.add(r"\\u" + _either_case(code, 4))
    ways.update("&" + re.escape(name) for name in _ENTITY_NAMES.get(char, ()))
    if char == "+":
        ways.add(" ")
    elif char == " ":
        ways.add(r"\+")
    alternatives = "(?:" + "|".join(sorted(ways, key=len, reverse=True)) + ")"
    return alternatives if first else _BACKSLASHES + alternatives


_ENTITY_NAMES: Final[dict[str, list[str]]] = {}
for _name, _char in html.entities.html5.items():
    if _name.endswith(";") and len(_char) == 1:
        _ENTITY_NAMES.setdefault(_char, []).append(_name)


def spelled(secret: str) -> str:
    """A regex for ``secret`` with each character in any of its spellings."""
    return "".join(_spellings(c, first=i == 0) for i, c in enumerate(secret))


WIDEST: Final = 48
"""The most characters one character of a secret takes in any of its spellings (four
backslashes, then the longest: a UTF-8 character's four ``\\xHH``), rounded up: how
far from its letters a spelled secret may reach."""


LOOSE_GAP: Final = 16
"""The most white space a secret's loose match allows between two of its characters
(a line wrapped and indented, ``\r\n`` and a few spaces)."""
LOOSE_PIECES: Final = 8
"""A secret broken by white space up to ``LOOSE_PIECES - 1`` times keeps a piece of
it whole, and only a text holding one, in any case, is searched loosely."""


_GAP_ITEM = re.compile(r"[\s\x00-\x1f\x7f-\x9f]|\\[nrtfv]")
"""One item of what a loose match lets stand between two characters of a secret: white
space, a control character, JSON's ``\\n`` and its kin."""
_GAP_ESCAPE = re.compile(r"\\[nrtfv]")
"""The items of ``_GAP_ITEM`` that are JSON escapes."""
_ASCII_GAPS = bytes(range(0x20)) + b" \x7f"
"""The items of ``_GAP_ITEM`` of one ASCII character (``\\s`` holds no other)."""


@functools.cache  # as the registry: a secret is never forgotten (see ``_compiled``)
def _loose(secret: str) -> re.Pattern[str]:
    """``secret`` in any case, with up to ``LOOSE_GAP`` white space characters between
    any two of its characters: a server that wraps its text may break a key it echoes
    with a line break, or upper-case it (a gateway client rebuilt the provider's key
    by deleting one space; found by a hunt)."""
    gap = f"(?:{_GAP_ITEM.pattern}){{0,{LOOSE_GAP}}}"
    return re.compile(gap.join(re.escape(c) for c in secret), re.IGNORECASE)


LOOSE_MIN: Final = 16
"""Secrets shorter than this are matched exactly only: loosely, a six-letter password
in a URL (``Summer``) masked ``summer sale`` and ``sum mer`` in every text (a review).
API keys are far longer."""


def _pieces(secret: str) -> tuple[str, ...]:
    """``secret`` lower-cased, in ``LOOSE_PIECES`` pieces that do not overlap and cover
    it (the last takes what is left): the gate of the loose search. Broken fewer times
    than that, a piece of it stays whole (a dropped last piece let seven breaks
    through a 57-character key; a review)."""
    low = secret.lower()
    size = len(low) // LOOSE_PIECES
    cuts = [k * size for k in range(LOOSE_PIECES)] + [len(low)]
    return tuple(low[a:b] for a, b in itertools.pairwise(cuts))


_FOLDED = (("\u0131", "i"), ("\u017f", "s"), ("\u0307", ""))
"""What ``lower`` leaves of the characters that match an ASCII letter in any case but
lower-case to none (``re.IGNORECASE``: U+0131, a dotless i, and U+017F, a long s; U+0130,
a capital I with a dot, lower-cases to ``i`` and U+0307, a dot above, dropped), written
as the letter."""


def _lowered(text: str) -> str:
    """``text`` lower-cased, and ``_FOLDED``: each ASCII letter ``re.IGNORECASE`` takes
    in any case is that letter, as the loose search reads it (a key whose one whole
    piece began with a long s was left whole; found by a hypothesis test). A text
    without such characters costs ``lower`` alone (an ASCII text is never searched)."""
    low = text.lower()
    for odd, letter in _FOLDED:
        if odd in low:
            low = low.replace(odd, letter)
    return low


def _squeezed(low: str) -> str:
    """``low`` (a text ``_lowered``) with everything ``_loose`` lets stand between two
    characters of a secret taken out: a secret spelled loosely in the text is there
    whole, but perhaps for its first character (a backslash before it may take it as
    an escape). A text of ASCII characters is squeezed in two passes of C, the escapes
    (where there is a backslash), then the characters (a 364 KB answer of embeddings in
    0.7 ms, not the 6.5 of one regular expression over it): the same, since neither
    pass makes or unmakes what the other takes out."""
    if not low.isascii():
        return _GAP_ITEM.sub("", low)
    if "\\" in low:
        low = _GAP_ESCAPE.sub("", low)
    return low.encode("ascii").translate(None, _ASCII_GAPS).decode("ascii")


def _tail(secret: str) -> str | None:
    """What ``_squeezed`` of a text spelling ``secret`` loosely must hold: the secret,
    lower-cased, but for its first character; None for a secret it says nothing of (one
    with characters outside ASCII, or any ``_GAP_ITEM`` takes: white space, a control
    character, a backslash)."""
    if not secret.isascii() or "\\" in secret or _GAP_ITEM.search(secret):
        return None
    return secret.lower()[1:]


class _Lowered:
    """A text as the loose search reads it (``_lowered``), ``_squeezed`` when first
    needed: what says whether the text may spell a secret loosely (``piece_of``), for
    ``hide`` and ``hide_after`` alike. ``tails``: a redactor's ``_Tails``, if it has
    many needles."""

    __slots__ = ("_found", "_squeezed", "_tails", "low")

    def __init__(self, low: str, tails: _Tails | None = None) -> None:
        self.low = low
        self._squeezed: str | None = None
        self._tails = tails
        self._found: frozenset[str] | None = None

    def piece_of(self, secret: _Loose) -> str | None:
        """A piece of ``secret`` the text holds, if the text may spell it loosely: a
        piece whole in any case and, for a key of ASCII characters, the key in the text
        with its white space taken out (a piece may be public: ``sk-proj``); else None."""
        if secret.tail is not None and not self._holds_tail(secret.tail):
            return None
        return next((p for p in secret.pieces if p in self.low), None)

    def _holds_tail(self, tail: str) -> bool:
        if self._squeezed is None:
            self._squeezed = _squeezed(self.low)
        if self._tails is None:
            return tail in self._squeezed
        if self._found is None:
            self._found = self._tails.found(self._squeezed)
        return tail in self._found


class _Tails:
    """Which loosely matched secrets' ``_tail`` a squeezed text holds, all found in one
    pass: a text naming many keys' public start (``sk-proj-``) had each of them look
    for its tail, 1.3 us a key (1.4 ms of a 1 KB answer with 1,000 keys)."""

    __slots__ = ("_automaton", "_names")

    def __init__(self, tails: Iterable[str]) -> None:
        self._names = tuple(sorted(set(tails)))
        self._automaton = ahocorasick_rs.AhoCorasick(
            list(self._names), matchkind=ahocorasick_rs.MATCHKIND_STANDARD
        )

    def found(self, squeezed: str) -> frozenset[str]:
        """The tails ``squeezed`` holds (every match, overlapping); every tail, for a text
        the automaton cannot read (``_matches``)."""
        matches = _matches(self._automaton, squeezed, overlapping=True)
        if matches is None:
            return frozenset(self._names)
        return frozenset(self._names[m[0]] for m in matches)


def _matches(
    automaton: ahocorasick_rs.AhoCorasick, text: str, *, overlapping: bool = False
) -> list[tuple[int, int, int]] | None:
    """``automaton``'s matches in ``text``; None for a text it cannot read. It reads
    UTF-8, and a text holding a lone surrogate (JSON's ``"\\ud800"``, parsed, is one) is
    none: it raised ``UnicodeEncodeError`` out of ``hide``, and out of every log call of
    the process once a secret was registered (found by a review). Its callers take such
    a text to hold every needle: everything is looked for in it, as before the gate."""
    try:
        return automaton.find_matches_as_indexes(text, overlapping=overlapping)
    except UnicodeEncodeError:
        return None


class _Loose:
    """A secret matched loosely (``_loose``): its pieces (the gate), its pattern, how far
    from a piece a match may reach, and its ``_tail``."""

    __slots__ = ("pattern", "pieces", "reach", "tail")

    def __init__(self, secret: str) -> None:
        self.pieces = _pieces(secret)
        self.pattern = _loose(secret)
        self.reach = len(secret) * (LOOSE_GAP + 1)
        self.tail = _tail(secret)


@functools.cache
def _compiled(secret: str) -> re.Pattern[str]:
    """``spelled(secret)``, compiled once per process (a registration rebuilds the
    redactor: compiling every secret's again cost 15 ms a secret). Kept for as long as
    the registry keeps its secret, for good: a cache of the last 256, rebuilt in the
    same order, missed every one past 256, and a 501st key took 7 s to register (a host
    making a system for each customer's key; found by a hunt)."""
    return re.compile(spelled(secret))


def _around(
    pattern: re.Pattern[str], text: str, anchor: str, reach: int, *, places: str | None = None
) -> str:
    """``text`` with ``pattern``'s matches masked, looked for only within ``reach``
    characters of each place ``anchor`` is (a spelled secret holds its anchor, so none
    lies elsewhere): a long text costs a substring search, not a scan by the regex
    (64 MB of backslashes after a key's letters took the I/O loop for a minute).
    ``places``: where to look for ``anchor`` instead (``text`` lower-cased, of its
    length)."""
    spans: list[tuple[int, int]] = []
    haystack = text if places is None else places
    at = haystack.find(anchor)
    while at != -1:
        lo, hi = max(0, at - reach), min(len(text), at + len(anchor) + reach)
        if spans and lo <= spans[-1][1]:
            spans[-1] = (spans[-1][0], hi)
        else:
            spans.append((lo, hi))
        at = haystack.find(anchor, at + 1)
    out: list[str] = []
    upto, found = 0, 0
    for lo, hi in spans:
        window, n = pattern.subn(MASK, text[lo:hi])
        if n:
            out += (text[upto:lo], window)
            upto, found = hi, found + n
    if not found:
        return text
    out.append(text[upto:])
    return "".join(out)


def _anchor(secret: str) -> str:
    """The longest run of letters and digits in ``secret`` (what no quoting changes),
    or the secret itself if it has none."""
    runs = re.findall(r"[A-Za-z0-9]+", secret)
    return max(runs, key=len) if runs else secret


def secrets_of(*values: str | Secret | None, urls: Iterable[str | Secret] = ()) -> set[str]:
    """The secrets to register for a model: each of ``values`` whole (an API key), and
    for each of ``urls`` its secret parts; a URL given as a ``Secret`` with no part
    known to be secret (a token in its path?) whole, with what of it a server may echo
    (``unmarked_secrets``: a 404 echoing the path had the token in results, logs and
    the gateway's error bodies; found by a hunt), a plain one with none nothing."""
    found = {reveal(v) for v in values if v is not None}
    for url in urls:
        parts = url_secrets(reveal(url))
        if not parts and isinstance(url, Secret):
            parts = unmarked_secrets(url.reveal())
        found.update(parts)
    return found


def _fewest(quoted: set[str]) -> set[str]:
    """One secret's forms without those that hold a shorter one: hiding the shorter
    hides them too, leaving only quoting around ``***`` (padding, escapes). Only
    within one secret: a secret inside another must not leave the other's rest."""
    kept: list[str] = []
    for form in sorted(quoted, key=len):
        if not any(k in form for k in kept):
            kept.append(form)
    return set(kept)


GATED_FROM: Final = 48
"""A redactor with this many needles or more (forms, anchors and loose pieces; one
API key has 17, three about 50) asks its ``_Gate`` which needles a text may hold
(every match) and looks only for those; one with fewer asks only whether the text
holds any (the first match, which the gate's prefilter finds fastest) and then looks
for all. Measured (the bench's ``redaction``): a 1 KB answer 4.2 us with one key,
11 us with 1,000, where looking for every form cost 10.6 us and 7.4 ms."""

SMALL_TEXT: Final = 256
"""A text shorter than this (a streamed event, a delta) is searched by a gate of few
needles with Python's ``in``, which keeps the interpreter's lock (``_Gate``): one
key's needles cost 2.3 us in 200 bytes, 7 us in 1 KB, where the automaton takes 0.5
and 1.4 us but hands the lock away."""


class _Gate:
    """Which of a redactor's needles a text may hold, found in one Aho-Corasick pass
    over the text in lower case (``ahocorasick_rs``: Rust's ``aho-corasick``, whose
    vectorised prefilter reads a 364 KB answer with one key's needles in 0.35 ms,
    where a substring search a needle took 0.2 ms each).

    Each needle stands for entries of the redactor (a form, a spelled secret, a
    loosely matched one, numbered in the order ``hide`` tries them). A needle of
    ASCII characters only is in a text only if its lower case is in the text's lower
    case (``lower`` maps each character alone but a capital sigma, no ASCII), so the
    entries of those not found are skipped, and those found are looked for as
    before: the gate only ever skips what cannot be there. A needle holding the mask's
    ``*`` may appear once another is masked: its entries are always looked for (and
    it is looked for too: a text holding none of the needles has nothing to mask). A
    needle with other characters may lower-case otherwise inside a text: its entries
    are always looked for, and no text is ever said to hold none.

    ``which``: the gate says which entries (every match, overlapping); else only
    whether the text holds any needle (the first match from the left, which the
    prefilter finds fastest), for a redactor that then looks for all of them.

    The automaton lets go of the interpreter's lock for every search: a search of 200
    bytes took 0.5 us alone and 53 us beside one thread running Python, which had the
    lock meanwhile. On the I/O loop that handed the lock to the actors at every
    streamed event and delta, and a stream's first token reached its reader 0.1-0.3 ms
    later at 200 streams (the bench's ``streaming``: the first event's read, 0.19-0.47
    ms over raw aiohttp's, 0.09-0.13 without). So a gate of few needles asks Python's
    own substring search (``in``, each needle) of a text shorter than ``SMALL_TEXT``:
    2.3 us for 200 bytes and one key's needles, 1 us a delta. A text the automaton
    cannot read (a lone surrogate: ``_matches``) holds every needle."""

    __slots__ = ("_always", "_automaton", "_blind", "_entries", "_needles")

    def __init__(self, needles: Iterable[tuple[str, int]], *, which: bool) -> None:
        entries: dict[str, list[int]] = {}
        always: set[int] = set()
        blind = False
        for needle, entry in needles:
            if not needle.isascii() or not needle:
                always.add(entry)
                blind = True
                continue
            if "*" in needle:
                always.add(entry)
            entries.setdefault(needle.lower(), []).append(entry)
        self._always = frozenset(always)
        self._blind = blind
        self._needles = () if which else tuple(entries)
        """The needles, for a short text (a gate of few: ``which`` is for many)."""
        self._entries = tuple(tuple(found) for found in entries.values())
        """Each needle's entries, by the needle's number in the automaton."""
        kind = (
            ahocorasick_rs.MATCHKIND_STANDARD if which else ahocorasick_rs.MATCHKIND_LEFTMOST_FIRST
        )
        self._automaton = ahocorasick_rs.AhoCorasick(list(entries), matchkind=kind)

    def entries(self, low: str) -> list[int]:
        """The entries whose needles ``low`` (a text lower-cased) may hold, in order (a
        gate made to say ``which``); every entry for a text the automaton cannot read."""
        found = set(self._always)
        matches = _matches(self._automaton, low, overlapping=True)
        numbers = range(len(self._entries)) if matches is None else {m[0] for m in matches}
        for number in numbers:
            found.update(self._entries[number])
        return sorted(found)

    def holds_none(self, low: str) -> bool:
        """Whether ``low`` (a text lower-cased) holds no needle: nothing to mask in it."""
        if self._blind:
            return False
        if self._needles and len(low) < SMALL_TEXT:
            return not any(needle in low for needle in self._needles)
        return _matches(self._automaton, low) == []


class Redactor:
    """Replaces every form of a fixed set of secrets with ``***``, longest first (a
    secret inside another is hidden with it). Immutable.

    Every text first goes through the redactor's ``_Gate``, one pass over it in lower
    case. A redactor of many secrets (``GATED_FROM``) asks it which forms, spelled and
    loose secrets the text may hold and looks only for those: the cost of a text then
    grows with the text, not with the secrets (a host that makes a system for each of
    its customers' keys registers them all). One of a few asks only whether the text
    holds any, and looks for all of them if it does: most texts hold none (an answer
    of 1 KB costs 4.2 us, not 10.6; a 364 KB answer of embeddings 0.48 ms, not 2.8)."""

    __slots__ = (
        "_breaks",
        "_forms",
        "_gate",
        "_gated",
        "_head_at",
        "_longest",
        "_loose",
        "_spelled",
        "_tails",
        "secrets",
    )

    def __init__(self, secrets: Iterable[str] = (), *, gated: bool | None = None) -> None:
        """``gated``: whether to ask a ``_Gate`` first (by default: with ``GATED_FROM``
        needles or more); the answers are the same either way."""
        self.secrets: frozenset[str] = frozenset(s for s in secrets if len(s) >= MIN_SECRET)
        found = set().union(*(_fewest(forms(s)) for s in self.secrets))
        self._forms: tuple[str, ...] = tuple(sorted(found, key=len, reverse=True))
        longest_first = sorted(self.secrets, key=len, reverse=True)  # a secret inside
        self._spelled = tuple(  # another is masked with it
            (_anchor(s), _compiled(s), len(s) * WIDEST) for s in longest_first
        )
        loose = [s for s in longest_first if len(s) >= LOOSE_MIN]
        self._loose = tuple(_Loose(s) for s in loose)
        self._breaks = _SPACES.difference(*self._forms)
        """What ends a held text's run: white space no form holds (every other character
        goes on with it, so where a run ends tells nothing of the secrets)."""
        heads = [re.escape(h) for h in sorted({form[:HEAD] for form in self._forms})]
        lows = sorted({h for s in loose for h in (s[:HEAD], s[:HEAD].lower())})
        if lows:  # as written too: "\u0130".lower() is two characters, none in the text
            heads.append("(?i:" + "|".join(map(re.escape, lows)) + ")")
        self._head_at = re.compile("|".join(heads))
        """Where the end begins that ``begun`` holds back: a form's first ``HEAD``
        characters, or a loosely matched secret's in any case."""
        self._longest = len(self._forms[0]) if self._forms else 0
        needles = [(form, i) for i, form in enumerate(self._forms)]
        base = len(self._forms)
        needles += ((anchor, base + i) for i, (anchor, _, _) in enumerate(self._spelled))
        base += len(self._spelled)
        needles += (
            (piece, base + i) for i, secret in enumerate(self._loose) for piece in secret.pieces
        )
        if gated is None:
            gated = len(needles) >= GATED_FROM
        self._gated = gated
        self._gate = _Gate(needles, which=gated) if needles else None
        tails = [secret.tail for secret in self._loose if secret.tail is not None]
        self._tails = _Tails(tails) if gated and tails else None

    def __bool__(self) -> bool:
        return bool(self._forms)

    def _candidates(
        self, text: str
    ) -> tuple[
        Sequence[str],
        Sequence[tuple[str, re.Pattern[str], int]],
        Sequence[_Loose],
        _Lowered,
    ]:
        """The forms, spelled secrets and loose ones ``text`` may hold, each in its
        order (those the gate finds, or all of them if it finds any), and the text as the
        gate read it."""
        gate = self._gate
        if gate is None:
            return (), (), (), _Lowered("", self._tails)
        view = _Lowered(_lowered(text), self._tails)
        low = view.low
        if not self._gated:
            if gate.holds_none(low):
                return (), (), (), view
            return self._forms, self._spelled, self._loose, view
        forms: list[str] = []
        spelled: list[tuple[str, re.Pattern[str], int]] = []
        loose: list[_Loose] = []
        n_forms, n_spelled = len(self._forms), len(self._spelled)
        for entry in gate.entries(low):
            if entry < n_forms:
                forms.append(self._forms[entry])
            elif entry < n_forms + n_spelled:
                spelled.append(self._spelled[entry - n_forms])
            else:
                loose.append(self._loose[entry - n_forms - n_spelled])
        return forms, spelled, loose, view

    def hide(self, text: str) -> str:
        """``text`` with every form of the secrets replaced (the same object when it
        holds none). A secret spelled with JSON's ``\\uXXXX`` escapes for some of its
        characters is hidden too (see ``_unescaped``)."""
        forms, spelled, loose_ones, view = self._candidates(text)
        read = text
        for form in forms:
            if form in text:
                text = text.replace(form, MASK)
        for anchor, pattern, reach in spelled:
            if anchor in text:
                text = _around(pattern, text, anchor, reach)
        if loose_ones:  # the gate's reading holds while the text is the one it read
            text = _hide_loose(text, loose_ones, view if text is read else None, self._tails)
        if self._forms and _escapes_ascii(text):
            plain = _unescaped(text)
            if plain != text:
                hidden = self.hide(plain)
                if hidden is not plain:
                    return hidden
        return text

    def hide_after(self, text: str, start: int) -> str:
        """``text[start:]`` with every form of a secret in ``text`` that ends after
        ``start`` masked there: ``text[:start]`` was shown already, so a secret begun
        in it is masked from ``start`` on."""
        new = text[start:]
        spans: list[tuple[int, int]] = []
        forms, _, loose_ones, view = self._candidates(text)
        for form in forms:
            at = text.find(form)
            while at != -1:
                if at + len(form) > start:
                    spans.append((max(at, start), at + len(form)))
                at = text.find(form, at + 1)
        for secret in loose_ones:  # in any case too (an upper-cased key went to the
            if view.piece_of(secret) is not None:  # reader whole; a review)
                found = secret.pattern.finditer(text)
                spans += ((max(m.start(), start), m.end()) for m in found)
        spans = [(b, e) for b, e in spans if e > start]
        if not spans:
            return new
        spans.sort()
        out, upto = [], start
        for begin, end in spans:
            if end <= upto:
                continue  # inside a span masked already
            if begin > upto:
                out.append(text[upto:begin])
            if begin >= upto:  # else it overlaps the last: its mask stands for both
                out.append(MASK)
            upto = end
        out.append(text[upto:])
        return "".join(out)

    def begun(self, text: str) -> int:
        """The length of the end of ``text`` a stream must hold back, for its next piece
        may finish a secret (0: none): the longest end, shorter than the longest form,
        that begins with a form's first ``HEAD`` characters and goes on without white
        space. Whether the rest of that end is a secret's beginning plays no part: a
        stream that held back what begins a secret, and let go what does not, told a
        client that made the model echo its guesses which guess went on as the key
        does, one character a request (found by a hunt: a key in 24 requests). What
        it still tells: a secret's first ``HEAD`` characters (public for most keys:
        ``sk-``), and the longest form's length.

        Linear in the window: the run is found first, then the first head in it. One
        expression for both (a head, then no white space to the end) read on from
        each head to the next break: a delta of repeated heads cost 35 ms at a JWT's
        length (found by a review)."""
        if not self._forms:
            return 0
        n = len(text)
        at = max(0, n - self._longest + 1)
        run = at  # where the end's run without white space begins
        for space in self._breaks:
            run = max(run, text.rfind(space, at) + 1)
        found = self._head_at.search(text, run)
        return 0 if found is None else n - found.start()

    def holds_no_needle(self, text: str) -> bool:
        """Whether ``text`` holds none of the gate's needles: ``hide_after`` masks
        nothing in it (``hide`` may, in what its escapes spell)."""
        gate = self._gate
        return gate is None or gate.holds_none(_lowered(text))


def _hide_loose(
    text: str, loose_ones: Sequence[_Loose], view: _Lowered | None, tails: _Tails | None
) -> str:
    """``text`` with each of ``loose_ones`` masked where it may be spelled loosely
    (``_Lowered.piece_of``), looked for near that piece (``_around``). ``view``: the text
    as read already, if it is this text (read again after each mask, with ``tails``)."""
    for secret in loose_ones:
        view = view or _Lowered(_lowered(text), tails)
        piece = view.piece_of(secret)
        if piece is None:
            continue
        if len(view.low) == len(text):  # each character in its place: look around
            text = _around(secret.pattern, text, piece, secret.reach, places=view.low)
        else:  # lower() changed a length (a non-ASCII letter): the whole text
            text = secret.pattern.sub(MASK, text)
        view = None
    return text


SHOWN_AT_MOST = 2
"""A stream shows at most this many characters of a secret's beginning (``sk``) before
it holds the text back: holding every text that ends as some secret begins (an ``s``)
would hold one character of most deltas for the next one."""
HEAD = SHOWN_AT_MOST + 1
"""A stream holds its text back from where a form's first ``HEAD`` characters appear
(``sk-``, for most keys public), whatever follows them."""
_SPACES = frozenset(" \t\n\r\x0b\x0c")
"""White space: where a held text's run ends (unless a secret holds it)."""
_ESCAPE_BODY = re.compile(r"(?:u[0-9A-Fa-f]{0,3})?")
"""What may follow the backslash of a JSON escape not finished yet."""


def _open_escape(text: str) -> int:
    """The length of a JSON escape begun at ``text``'s end and not finished (a
    backslash, then perhaps a ``u`` and up to three hex digits), 0 if none: what a
    tool call's arguments cut between two pieces leave, unescaped with the next. A
    backslash escaped itself (one of a pair) begins none; linear in the backslashes
    before it, however many a hostile stream sends."""
    if "\\" not in text[-5:]:
        return 0  # nearly always
    for size in range(min(5, len(text)), 0, -1):
        start = len(text) - size
        if text[start] == "\\" and _ESCAPE_BODY.fullmatch(text, start + 1):
            before = start
            while before and text[before - 1] == "\\":
                before -= 1
            if (start - before) % 2 == 0:  # its own backslash is not escaped
                return size
    return 0


class SpelledGuard:
    """Hides a secret that a stream spells across its pieces (each event is hidden
    alone, so a key echoed two characters an event was none of its forms in any).

    ``through(key, piece)`` gives what of ``piece`` may go to the reader now, of one
    stream of text (a choice's content, a tool call's arguments...): hidden, a
    secret begun in what was shown masked from where the showing stopped, less the
    text's end from where it begins as a secret's form does (its first ``HEAD``
    characters) while it runs on in key characters, whatever they are (``begun``:
    held for the next piece); ``rest(key)`` gives what is held when the text ends.
    So a reader sees at most ``SHOWN_AT_MOST`` characters of a secret the stream
    spells whole, then ``***``; a text that ends in the middle of one shows what it
    spelled, as ``hide`` does (only whole secrets are secrets). A stream of a
    process with no secret costs one test a piece."""

    __slots__ = ("_held", "_redactor", "_shown", "hid")

    def __init__(self) -> None:
        self._redactor = _current
        self.hid = False
        """Whether a secret was hidden: the stream's logprobs, token by token, spell it."""
        self._held: dict[Any, str] = {}
        self._shown: dict[Any, str] = {}
        """The last ``SHOWN_AT_MOST`` characters let go of each text."""

    def __bool__(self) -> bool:
        return bool(self._redactor)

    def through(self, key: Any, piece: str, *, raw: bool = False) -> str:
        """What of ``piece`` may go now (see the class); ``raw``: ``piece`` is text as
        read, never JSON (a token's): no escape in it is read, none held open."""
        redactor = self._redactor
        held = self._held.pop(key, "")
        text = held + piece if held else piece
        if not text or not redactor:
            return text
        if not raw and _escapes_ascii(text):
            text = _unescaped(text)  # a tool call's JSON arguments may escape a key (hide)
        shown = self._shown.get(key, "")
        whole = shown + text
        if not redactor.holds_no_needle(whole):  # nearly always: it holds none
            hidden = redactor.hide_after(whole, len(shown))
            if hidden != text:
                self.hid = True
            text = hidden
        keep = redactor.begun(shown + text)
        keep = min(keep, len(text)) if keep > SHOWN_AT_MOST else 0
        if not raw:
            keep = max(keep, _open_escape(text))  # a key escaped, cut inside an escape
        if keep:
            self._held[key] = text[-keep:]
            text = text[:-keep]
        self._shown[key] = (shown + text)[-SHOWN_AT_MOST:]
        return text

    def hold_whole(self, key: Any, piece: str) -> None:
        """Hold ``piece`` after what the text ``key`` holds, whatever it is: a text its
        reader must get whole (a tool call's name: held from a key's public head, as
        ``through`` holds, ``ask-user`` reached a reader as ``a``, then ``sk-user``,
        and the gateway named the tool ``a``; a review), let go by ``rest``."""
        self._held[key] = self._held.get(key, "") + piece

    def rest(self, key: Any) -> str:
        """What is held of the text ``key`` (the text has ended, or given way to another:
        it is no secret)."""
        held = self._held.pop(key, "")
        if held:
            self._shown[key] = (self._shown.get(key, "") + held)[-SHOWN_AT_MOST:]
        return held

    def held(self) -> list[Any]:
        """The keys of the texts holding something back."""
        return list(self._held)

    def holds(self, key: Any) -> bool:
        """Whether the text ``key`` holds something back."""
        return key in self._held


_ESCAPE = re.compile(r"\\(?:u([0-9A-Fa-f]{4})|.)", re.DOTALL)
"""A backslash and what it escapes, left to right: an escaped backslash is consumed
whole, so the ``u`` after it starts no escape."""
_ASCII_ESCAPE = re.compile(r"\\u00[2-7][0-9A-Fa-f]")
"""An escape of a printable ASCII character: none in a text, and no escape in it can
spell a secret (text escaped for being non-ASCII, the usual case, costs one scan)."""
_PLAIN = frozenset(string.ascii_letters + string.digits + "+/=-_.~:@!$%^*(),;")
"""Characters a JSON escape may stand for that are plain in a JSON string too."""


def _escapes_ascii(text: str) -> bool:
    """Whether ``text`` holds a JSON escape of a printable ASCII character (the one
    kind ``_unescaped`` writes plain): a test of one scan (a backslash is looked for
    with ``memchr``: ``"\\u" in text`` took 0.4 ms of a 364 KB answer), more for
    escaped text."""
    return "\\" in text and "\\u" in text and _ASCII_ESCAPE.search(text) is not None


def _unescaped(text: str) -> str:
    """``text`` with each JSON ``\\uXXXX`` escape of a character in ``_PLAIN`` written
    plain. A JSON serialiser may escape any character (.NET's writes ``+`` as
    ``\\u002B``, Gson ``=`` as ``\\u003d``): a key echoed so is none of its forms,
    yet the parsed JSON holds the key. Writing those characters plain changes no JSON
    text's meaning (neither ``"`` nor ``\\`` nor a control character is among them),
    so the result may be parsed in the text's stead; a ``\\`` escaped before the
    ``u`` (``\\\\u0041``, a backslash and text) is left alone."""

    def plain(match: re.Match[str]) -> str:
        code = match.group(1)
        if code is None:  # another escape (an escaped backslash too): as it was
            return match.group(0)
        char = chr(int(code, 16))
        return char if char in _PLAIN else match.group(0)

    return _ESCAPE.sub(plain, text)


_lock = threading.Lock()
_current = Redactor()
_installed = False


def register(secrets: Iterable[str]) -> None:
    """Hide ``secrets`` from now on, in ``hide`` and in every log record made after."""
    global _current  # noqa: PLW0603 - the process's one registry, replaced whole
    with _lock:
        known = _current.secrets
        more = {s for s in secrets if len(s) >= MIN_SECRET} - known
        if not more:
            return
        _current = Redactor(known | more)
        _install()


def active() -> bool:
    """Whether any secret is registered (none: nothing is ever hidden)."""
    return bool(_current)


def hide(text: str) -> str:
    """``text`` with every registered secret, in every form, replaced by ``***``."""
    return _current.hide(text)


def hide_json(value: Any) -> Any:
    """``value`` (parsed JSON) with every registered secret hidden in its strings: the
    same object when it holds none."""
    redactor = _current
    if not redactor:
        return value
    text = json.dumps(value, ensure_ascii=False)
    hidden = redactor.hide(text)
    return value if hidden is text else json.loads(hidden)


def hide_cut(text: str, limit: int) -> str:
    """``text`` hidden, then cut to ``limit`` characters (hidden first: a cut must not
    keep the head of a secret that a later cut would no longer recognise)."""
    return _current.hide(text)[:limit]


_EXC_FORMATTER = logging.Formatter()


def redact_record(record: logging.LogRecord) -> None:
    """Rewrite ``record`` in place if its message, traceback, stack or ``extra=``
    fields hold a secret: the message is formatted, hidden and stored with no args (a
    message that is a dict or list with no args, as structlog's bridge makes, keeps its
    shape, each text in it hidden); the traceback is formatted and hidden into
    ``exc_text`` (what formatters print); the fields' texts are hidden where they are,
    in dicts and lists too."""
    redactor = _current
    if not redactor:
        return
    if isinstance(record.msg, dict | list) and not record.args:
        # structlog's ProcessorFormatter reads its event dict from ``msg``: made a str,
        # every record naming a key was lost to an AttributeError (found by a hunt)
        record.msg = _hidden_value(redactor, record.msg)
    else:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format: its handler reports
            return
        hidden = redactor.hide(message)
        if hidden is not message:
            record.msg, record.args = hidden, ()
    if record.exc_info and not record.exc_text:
        text = _EXC_FORMATTER.formatException(record.exc_info)
        hidden = redactor.hide(text)
        if hidden is not text:
            record.exc_text = hidden
            record.exc_info = None  # a handler that formats it again would show it
    if record.stack_info:
        record.stack_info = redactor.hide(record.stack_info)
    fields = record.__dict__  # ``extra=``: set after the factory, so a filter's (below)
    for key, value in fields.items():
        if key not in _STANDARD:
            fields[key] = _hidden_value(redactor, value)


def _hidden_value(redactor: Redactor, value: Any) -> Any:
    """``value`` with its secrets hidden: in its texts, in dicts, lists and tuples too,
    its shape kept (the same object where it holds none); where a secret is left
    outside those texts (in an exception, bytes, a key, past ``_DEEPEST`` levels), all
    of it as its hidden text instead, as a message always was (a review: the shape
    kept, an exception's words in a dict showed the key)."""
    if isinstance(value, str):
        return redactor.hide(value)
    shaped = _hide_within(redactor, value, _DEEPEST)
    try:
        text = str(shaped)  # the text a formatter writes of it
    except Exception:  # noqa: BLE001 - unprintable: its handler reports it, as before
        return shaped
    hidden = redactor.hide(text)
    return shaped if hidden is text else hidden


_DEEPEST = 20
"""How deep ``_hide_within`` goes (a dict holding itself went on until RecursionError,
raised to whoever logged it: a review)."""


def _hide_within(redactor: Redactor, value: Any, depth: int) -> Any:
    """``value`` with the secrets in its texts hidden, in dicts, lists and tuples down
    to ``depth`` levels (the same object where it holds none, another where it does)."""
    if isinstance(value, str):
        return redactor.hide(value)
    if depth > 0 and isinstance(value, dict):
        pairs = [(k, _hide_within(redactor, v, depth - 1)) for k, v in value.items()]
        same = all(new is old for (_, new), old in zip(pairs, value.values(), strict=True))
        return value if same else dict(pairs)
    if depth > 0 and isinstance(value, list | tuple):
        items = [_hide_within(redactor, v, depth - 1) for v in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        return items if isinstance(value, list) else tuple(items)
    return value


_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
"""A record's own attributes; any other was passed as ``extra=``."""


class RedactingFilter(logging.Filter):
    """A handler filter that redacts every record it sees (``redact_record``); drops
    nothing. The record factory cannot see ``extra=`` fields (``Logger.makeRecord``
    sets them after it): a handler with this filter hides them too. callboard's own
    handlers have it; a host that logs secrets in ``extra=`` adds it to its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        redact_record(record)
        return True


def _install() -> None:
    """Chain ``redact_record`` into logging's record factory, once. Under ``_lock``."""
    global _installed  # noqa: PLW0603 - installed once per process
    if _installed:
        return
    made: Callable[..., logging.LogRecord] = logging.getLogRecordFactory()

    def redacted(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = made(*args, **kwargs)
        redact_record(record)
        return record

    logging.setLogRecordFactory(redacted)
    _installed = True
