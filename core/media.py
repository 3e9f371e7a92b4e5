"""What an attachment measures, read from its own bytes: an image's pixel size, an audio
clip's length, a PDF's page count.

Theory of operation
-------------------
A chat part carries a file base64-encoded, usually in a data URL
(``data:image/png;base64,iVBOR...``). The token rules in ``core.tokens`` need
only a number or two from it, and those sit in the file's header: a PNG's
IHDR chunk, a GIF's screen descriptor, a WebP's VP8/VP8L/VP8X header, a
JPEG's start-of-frame segment, a WAV's fmt chunk, an MP3's first frame
header. Base64 turns every 4 characters into 3 bytes, so ``_Base64.read``
decodes any byte range without decoding what comes before it: a JPEG's
segments are walked by their lengths, an MP3's ID3 tag is skipped, and a
20 MB image costs a few hundred bytes of decoding. The format is sniffed from
the bytes, never taken from the URL's media type (which may be wrong). A PDF
is the exception: its pages are counted over the whole file, including the
compressed object streams where PDF 1.5 and later keep their page objects.

What always holds: pure (no I/O; ``zlib`` and ``binascii`` only); no function
here raises, whatever string it is given; an answer is what the file says or
``None`` (not base64 data, a format this module does not read, a truncated or
malformed header), and the caller decides what an unknown costs.
"""

from __future__ import annotations

import binascii
import re
import struct
import zlib

__all__ = ["audio_seconds", "decoded_size", "image_size", "pdf_pages"]

_MAX_SEGMENTS = 512
"""JPEG segments (or WAV chunks) walked before giving up: real files reach their
start-of-frame within a few dozen."""
_MP3_SYNC_WINDOW = 8192
"""Bytes searched for an MP3's first frame header after its ID3 tag."""
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
"""Start-of-frame markers (baseline, progressive, lossless, arithmetic); C4, C8 and CC
are other segments."""
_MP3_KBPS = {
    3: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),  # MPEG-1
    2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),  # MPEG-2
    0: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),  # MPEG-2.5
}
"""Layer III bitrates by the frame header's version bits and bitrate index."""
_MAX_INFLATED = 16 * 1024 * 1024
"""Bytes one PDF object stream may inflate to (a bound against compression bombs)."""
_PDF_PAGE = re.compile(rb"/Type\s*/Page(?![A-Za-z])")
_PDF_OBJECT_STREAM = re.compile(rb"/Type\s*/ObjStm[^>]*>>\s*stream\r?\n")


class _Base64:
    """Random access to the bytes a base64 text encodes."""

    def __init__(self, text: str) -> None:
        self._text = text
        padding = len(text) - len(text.rstrip("="))
        self.size = max(0, len(text) * 3 // 4 - padding)

    def read(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes from ``offset``; fewer at the end, none if undecodable."""
        if offset < 0 or n <= 0:
            return b""
        start = offset // 3 * 4
        chunk = self._text[start : -(-(offset + n) // 3) * 4]
        try:
            raw = binascii.a2b_base64(chunk + "=" * (-len(chunk) % 4))
        except ValueError:  # binascii.Error, or a character outside ASCII
            return b""
        skip = offset - start // 4 * 3
        return raw[skip : skip + n]

    def all(self) -> bytes:
        return self.read(0, self.size)


def _payload(data: str) -> str | None:
    """The base64 text of a data URL, or ``data`` itself when it is bare base64."""
    if not data.startswith(("data:", "DATA:", "Data:")):
        return data if data and "://" not in data[:16] else None
    header, comma, payload = data.partition(",")
    return payload if comma and header.lower().endswith(";base64") else None


def decoded_size(data: str) -> int | None:
    """How many bytes a data URL (or bare base64) holds."""
    payload = _payload(data)
    return None if payload is None else _Base64(payload).size


# -- images ---------------------------------------------------------------------------------


def image_size(url: str) -> tuple[int, int] | None:
    """(width, height) in pixels of a base64 PNG, JPEG, GIF or WebP; None if unknown
    (an http(s) URL, another format, a broken header)."""
    payload = _payload(url) if url.startswith(("data:", "DATA:", "Data:")) else None
    if payload is None:
        return None
    data = _Base64(payload)
    head = data.read(0, 32)
    if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
        size = struct.unpack(">II", head[16:24]) if len(head) >= 24 else None
    elif head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        size = struct.unpack("<HH", head[6:10])
    elif head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        size = _webp_size(head)
    elif head[:2] == b"\xff\xd8":
        size = _jpeg_size(data)
    else:
        size = None
    return (size[0], size[1]) if size and size[0] > 0 and size[1] > 0 else None


def _webp_size(head: bytes) -> tuple[int, int] | None:
    if len(head) < 30:
        return None
    kind = head[12:16]
    if kind == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", head[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if kind == b"VP8L" and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8X":
        return int.from_bytes(head[24:27], "little") + 1, int.from_bytes(head[27:30], "little") + 1
    return None


def _jpeg_size(data: _Base64) -> tuple[int, int] | None:
    pos = 2
    for _ in range(_MAX_SEGMENTS):
        seg = data.read(pos, 9)
        if len(seg) < 4 or seg[0] != 0xFF:
            return None
        marker = seg[1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
        elif marker in _JPEG_SOF:
            if len(seg) < 9:
                return None
            height, width = struct.unpack(">HH", seg[5:9])
            return width, height
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
        elif marker in (0xD9, 0xDA):  # end of image, or scan data before any frame header
            return None
        else:
            length = struct.unpack(">H", seg[2:4])[0]
            if length < 2:
                return None
            pos += 2 + length
    return None


# -- audio ----------------------------------------------------------------------------------


def audio_seconds(data: str, audio_format: str) -> float | None:
    """How long a base64 ``wav`` or ``mp3`` clip plays; None if its header is unreadable."""
    payload = _payload(data)
    if payload is None:
        return None
    clip = _Base64(payload)
    if audio_format == "wav":
        return _wav_seconds(clip)
    if audio_format == "mp3":
        return _mp3_seconds(clip)
    return None


def _wav_seconds(clip: _Base64) -> float | None:
    head = clip.read(0, 12)
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    pos, byte_rate, data_bytes = 12, 0, None
    for _ in range(_MAX_SEGMENTS):
        chunk = clip.read(pos, 16)
        if len(chunk) < 8:
            break
        size = int.from_bytes(chunk[4:8], "little")
        if chunk[:4] == b"fmt " and len(chunk) == 16:
            byte_rate = int.from_bytes(clip.read(pos + 16, 4), "little")
        elif chunk[:4] == b"data":
            data_bytes = min(size, clip.size - pos - 8)  # a streamed file writes 0xFFFFFFFF
            break
        pos += 8 + size + (size & 1)  # chunks are padded to an even length
    if byte_rate <= 0:
        return None
    return max(0, clip.size - pos if data_bytes is None else data_bytes) / byte_rate


def _mp3_seconds(clip: _Base64) -> float | None:
    pos = 0
    tag = clip.read(0, 10)
    if tag[:3] == b"ID3" and len(tag) == 10:
        size = (tag[6] & 0x7F) << 21 | (tag[7] & 0x7F) << 14 | (tag[8] & 0x7F) << 7 | tag[9] & 0x7F
        pos = 10 + size + (10 if tag[5] & 0x10 else 0)  # the footer flag adds 10 bytes
    window = clip.read(pos, _MP3_SYNC_WINDOW)
    for i in range(len(window) - 3):
        kbps = _mp3_frame_kbps(window[i : i + 4])
        if kbps:
            return (clip.size - pos - i) * 8 / (kbps * 1000)
    return None


def _mp3_frame_kbps(header: bytes) -> int:
    """The bitrate a Layer III frame header states, or 0 if these bytes are not one."""
    if header[0] != 0xFF or header[1] & 0xE0 != 0xE0 or (header[1] >> 1) & 3 != 1:
        return 0
    table = _MP3_KBPS.get((header[1] >> 3) & 3)
    index = header[2] >> 4
    return table[index] if table is not None and index < len(table) else 0


# -- documents ------------------------------------------------------------------------------


def pdf_pages(data: str) -> int | None:
    """How many pages a base64 PDF has (its page objects, compressed ones included);
    None if it is not a PDF or none are found."""
    payload = _payload(data)
    if payload is None:
        return None
    raw = _Base64(payload).all()
    if b"%PDF-" not in raw[:1024]:  # the header may follow up to 1 KB of other bytes
        return None
    pages = len(_PDF_PAGE.findall(raw))
    view = memoryview(raw)
    for match in _PDF_OBJECT_STREAM.finditer(raw):
        try:
            objects = zlib.decompressobj().decompress(view[match.end() :], _MAX_INFLATED)
        except zlib.error:
            continue
        pages += len(_PDF_PAGE.findall(objects))
    return pages or None
