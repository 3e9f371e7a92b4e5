"""Attachment sizes read from their own bytes (core/media.py): image headers of every
format a chat accepts, audio clip lengths, PDF page counts; unknown is None, never an
error."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest
from callboard.core.media import audio_seconds, decoded_size, image_size, pdf_pages
from hypothesis import given
from hypothesis import strategies as st


def data_url(kind: str, raw: bytes) -> str:
    return f"data:{kind};base64,{base64.b64encode(raw).decode()}"


def png(width: int, height: int, tail: bytes = b"") -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + crc + tail


def gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00\x00\x00;"


def webp_lossy(width: int, height: int) -> bytes:
    frame = b"\x00\x00\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", width, height) + b"\x00" * 8
    return (
        b"RIFF"
        + struct.pack("<I", 4 + 8 + len(frame))
        + b"WEBPVP8 "
        + struct.pack("<I", len(frame))
        + frame
    )


def webp_lossless(width: int, height: int) -> bytes:
    bits = (width - 1) | (height - 1) << 14
    frame = b"\x2f" + bits.to_bytes(4, "little") + b"\x00" * 8
    return (
        b"RIFF"
        + struct.pack("<I", 4 + 8 + len(frame))
        + b"WEBPVP8L"
        + struct.pack("<I", len(frame))
        + frame
    )


def webp_extended(width: int, height: int) -> bytes:
    body = b"\x00" * 4 + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return (
        b"RIFF"
        + struct.pack("<I", 4 + 8 + len(body))
        + b"WEBPVP8X"
        + struct.pack("<I", len(body))
        + body
    )


def jpeg(width: int, height: int, *, exif_bytes: int = 0, progressive: bool = False) -> bytes:
    """SOI, a JFIF APP0, an EXIF APP1 of ``exif_bytes`` (a camera's thumbnail sits there),
    a fill byte, then the frame header and the start of a scan."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    app1 = b"\xff\xe1" + struct.pack(">H", 2 + exif_bytes) + b"\xab" * exif_bytes
    sof = b"\xff\xc2" if progressive else b"\xff\xc0"
    frame = sof + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + app1 + b"\xff" + frame + b"\xff\xda\x00\x08" + b"\x00" * 64


def wav(
    seconds: float, *, rate: int = 16_000, channels: int = 1, extra_chunk: bool = True
) -> bytes:
    byte_rate = rate * channels * 2
    fmt = struct.pack("<HHIIHH", 1, channels, rate, byte_rate, channels * 2, 16)
    samples = b"\x00" * int(seconds * byte_rate)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    if extra_chunk:  # a LIST chunk of odd length, padded, before the data
        chunks += b"LIST" + struct.pack("<I", 5) + b"INFOx\x00"
    chunks += b"data" + struct.pack("<I", len(samples)) + samples
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def mp3(seconds: float, *, kbps: int = 128, id3_bytes: int = 0) -> bytes:
    """An ID3v2 tag of ``id3_bytes`` (album art lives there), then MPEG-1 Layer III
    frames at ``kbps``."""
    tag = b""
    if id3_bytes:
        size = bytes((id3_bytes >> s) & 0x7F for s in (21, 14, 7, 0))
        tag = b"ID3\x04\x00\x00" + size + b"\x00" * id3_bytes
    index = (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320).index(kbps)
    header = bytes((0xFF, 0xFB, index << 4 | 0x0, 0x44))  # 44.1 kHz, no padding
    audio = int(seconds * kbps * 1000 / 8)
    return tag + (header + b"\x00" * 413) * (audio // 417) + b"\x00" * (audio % 417)


def pdf(pages: int, *, compressed: bool = False) -> bytes:
    """A PDF whose page objects are plain text, or (PDF 1.5) inside a compressed object
    stream."""
    objects = b"".join(b"<< /Type /Page /Parent 2 0 R >>\n" for _ in range(pages))
    tree = b"2 0 obj << /Type /Pages /Count %d >> endobj\n" % pages
    if not compressed:
        return b"%PDF-1.4\n" + tree + objects + b"%%EOF"
    packed = zlib.compress(objects)
    head = b"<< /Type /ObjStm /N %d /First 0 /Length %d /Filter /FlateDecode >>" % (
        pages,
        len(packed),
    )
    return b"%PDF-1.7\n" + head + b"\nstream\n" + packed + b"\nendstream\n%%EOF"


# -- images ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "build"),
    [
        ("image/png", png),
        ("image/gif", gif),
        ("image/webp", webp_lossy),
        ("image/webp", webp_lossless),
        ("image/webp", webp_extended),
        ("image/jpeg", jpeg),
    ],
)
@pytest.mark.parametrize(("width", "height"), [(1, 1), (1024, 768), (333, 4000), (16383, 2)])
def test_an_image_size_is_read_from_its_header(
    kind: str, build: object, width: int, height: int
) -> None:
    assert callable(build)
    assert image_size(data_url(kind, build(width, height))) == (width, height)


def test_a_jpeg_frame_header_is_found_past_a_large_exif_segment() -> None:
    photo = jpeg(4032, 3024, exif_bytes=60_000, progressive=True) + b"\x00" * 2_000_000
    assert image_size(data_url("image/jpeg", photo)) == (4032, 3024)


def test_the_format_comes_from_the_bytes_not_the_media_type() -> None:
    assert image_size(data_url("image/jpeg", png(640, 480))) == (640, 480)
    assert image_size(data_url("application/octet-stream", gif(7, 9))) == (7, 9)


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/cat.png",
        "http://example.com/cat.png",
        "data:image/png,not-base64-encoded",
        "data:image/png;base64",
        "data:image/png;base64,",
        "data:image/png;base64,!!!!",
        "data:image/png;base64,é",
        data_url("image/png", png(640, 480)[:20]),  # cut inside IHDR
        data_url("image/png", png(0, 480)),
        data_url("image/bmp", b"BM" + b"\x00" * 60),
        data_url("image/jpeg", b"\xff\xd8\xff\xd9"),  # ends before any frame header
        data_url("image/jpeg", b"\xff\xd8\xff\xe0\x00\x01"),  # a segment length below 2
        data_url("image/jpeg", jpeg(100, 100)[:30]),
        data_url("image/webp", webp_lossy(10, 10)[:25]),
        data_url("image/webp", b"RIFF\x00\x00\x00\x00WEBPVP8Z" + b"\x00" * 30),
    ],
)
def test_an_image_it_cannot_measure_is_unknown(url: str) -> None:
    assert image_size(url) is None


@given(st.text(max_size=300))
def test_any_text_as_an_image_url_is_measured_or_unknown(text: str) -> None:
    for url in (text, "data:image/png;base64," + text, "data:image/jpeg;base64,/9j/" + text):
        size = image_size(url)
        assert size is None or (size[0] > 0 and size[1] > 0)


@given(st.binary(max_size=200))
def test_any_bytes_as_an_image_are_measured_or_unknown(raw: bytes) -> None:
    for head in (b"", b"\xff\xd8", b"\x89PNG\r\n\x1a\n", b"RIFF\x00\x00\x00\x00WEBPVP8X"):
        size = image_size(data_url("image/png", head + raw))
        assert size is None or min(size) > 0


# -- audio ----------------------------------------------------------------------------------


@pytest.mark.parametrize("extra_chunk", [False, True])
def test_a_wav_clip_lasts_its_data_over_its_byte_rate(extra_chunk: bool) -> None:
    clip = base64.b64encode(wav(2.5, rate=16_000, channels=2, extra_chunk=extra_chunk)).decode()
    assert audio_seconds(clip, "wav") == pytest.approx(2.5)
    assert audio_seconds("data:audio/wav;base64," + clip, "wav") == pytest.approx(2.5)


def test_a_streamed_wav_without_a_data_length_lasts_what_follows_its_header() -> None:
    raw = bytearray(wav(1.0, extra_chunk=False))
    raw[40:44] = b"\xff\xff\xff\xff"  # the data chunk's size, unknown when it was written
    seconds = audio_seconds(base64.b64encode(bytes(raw)).decode(), "wav")
    assert seconds == pytest.approx(1.0)


@pytest.mark.parametrize(("kbps", "id3_bytes"), [(128, 0), (64, 0), (320, 0), (128, 300_000)])
def test_an_mp3_clip_lasts_its_bytes_at_its_first_frame_bitrate(kbps: int, id3_bytes: int) -> None:
    clip = base64.b64encode(mp3(12.0, kbps=kbps, id3_bytes=id3_bytes)).decode()
    assert audio_seconds(clip, "mp3") == pytest.approx(12.0, rel=0.01)


@pytest.mark.parametrize(
    ("data", "fmt"),
    [
        (base64.b64encode(b"RIFF\x00\x00\x00\x00WAVE").decode(), "wav"),  # no fmt chunk
        (base64.b64encode(b"not a riff file at all").decode(), "wav"),
        (base64.b64encode(b"\x00" * 5000).decode(), "mp3"),  # no frame header
        (base64.b64encode(wav(1.0)).decode(), "ogg"),
        ("https://example.com/a.mp3", "mp3"),
    ],
)
def test_a_clip_it_cannot_read_is_unknown(data: str, fmt: str) -> None:
    assert audio_seconds(data, fmt) is None


@given(st.binary(max_size=300), st.sampled_from(["wav", "mp3"]))
def test_any_bytes_as_audio_are_timed_or_unknown(raw: bytes, fmt: str) -> None:
    for head in (b"", b"RIFF\x00\x00\x00\x00WAVEfmt ", b"ID3\x04\x00\x00", b"\xff\xfb"):
        seconds = audio_seconds(base64.b64encode(head + raw).decode(), fmt)
        assert seconds is None or seconds >= 0


# -- documents and sizes --------------------------------------------------------------------


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("pages", [1, 3, 40])
def test_a_pdf_has_as_many_pages_as_page_objects(pages: int, compressed: bool) -> None:
    assert pdf_pages(data_url("application/pdf", pdf(pages, compressed=compressed))) == pages


def test_what_is_not_a_pdf_has_no_page_count() -> None:
    assert pdf_pages(data_url("text/plain", b"/Type /Page, but no PDF header")) is None
    assert pdf_pages(data_url("application/pdf", b"%PDF-1.4\nno pages here")) is None
    assert pdf_pages("file-abc123") is None


def test_a_data_url_holds_its_decoded_bytes() -> None:
    for n in (0, 1, 2, 3, 4, 1000):
        assert decoded_size(data_url("application/pdf", b"x" * n)) == n
    assert decoded_size("https://example.com/a.pdf") is None
