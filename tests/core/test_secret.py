"""What in a URL is a secret, and how a secret shows (core/secret.py): the userinfo and
key-like query values are found as written and decoded, masked in what is shown, and a
URL with none stays a plain string."""

from __future__ import annotations

import pytest
from callboard.core.secret import (
    MASK,
    Secret,
    guarded_url,
    masked_url,
    quoted,
    reveal,
    shown,
    unmarked_secrets,
    url_credentials,
    url_secrets,
)

KEY = "sk-cb-SECRET-7f3a9"


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("https://api.example/v1", "https://api.example/v1"),
        (
            "https://api.example/v1?api-version=2024-06-01",
            "https://api.example/v1?api-version=2024-06-01",
        ),
        (f"https://api.example/v1?key={KEY}", "https://api.example/v1?key=***"),
        (
            f"https://h/v1?api-version=1&api_key={KEY}&x=2",
            "https://h/v1?api-version=1&api_key=***&x=2",
        ),
        (f"https://h/v1?api-key={KEY}", "https://h/v1?api-key=***"),
        (f"https://h/v1?access_token={KEY}#frag", "https://h/v1?access_token=***#frag"),
        (f"https://h/v1?sig={KEY}&se=2030", "https://h/v1?sig=***&se=2030"),
        (f"https://h/v1?X-Amz-Credential={KEY}", "https://h/v1?X-Amz-Credential=***"),
        (f"https://bob:{KEY}@h:8443/v1", "https://bob:***@h:8443/v1"),
        (f"https://{KEY}@h/v1", "https://***@h/v1"),
        (f"https://{KEY}:@h/v1", "https://***@h/v1"),
        ("https://h/v1?key=", "https://h/v1?key="),  # nothing there to hide
        (f"https://h/api?code={KEY}", "https://h/api?code=***"),  # Azure Functions
        (f"https://h/v1?session={KEY}", "https://h/v1?session=***"),
        ("https://h/v1?postcode=N1", "https://h/v1?postcode=N1"),  # a word, not a part
    ],
)
def test_a_url_shows_with_its_secret_parts_masked(url: str, masked: str) -> None:
    assert masked_url(url) == masked
    assert KEY not in masked_url(url)


def test_a_password_with_an_unencoded_slash_masks_the_whole_url() -> None:
    url = f"http://bob:{KEY[:6]}/{KEY[6:]}@h/v1"  # the authority ends at the '/'
    assert masked_url(url) == MASK
    assert url_secrets(url) == (url,)


def test_url_secrets_lists_each_part_as_written_and_decoded() -> None:
    url = "https://us%40er:p%3Ass-w0rd@h/v1?token=abc%2Fdef12&api-version=1"
    found = set(url_secrets(url))
    assert {"p%3Ass-w0rd", "p:ss-w0rd", "us%40er:p%3Ass-w0rd", "us@er:p:ss-w0rd"} <= found
    assert {"abc%2Fdef12", "abc/def12"} <= found
    assert "1" not in found
    assert "us%40er" not in found, "a user name beside a password is not the secret"


def test_a_secret_url_with_no_known_part_lists_its_token_like_parts() -> None:
    token = "tok7f3a9c2e81d4b6a05e9f1"  # noqa: S105 - a made-up one
    uuid = "40c8e562-e583-46aa-9182-9cf08dede17b"
    url = f"https://{token}.tunnel.example/deployments/{uuid}/v1?api-version=2024-10-21&sas=a%2Fb{token}"
    found = unmarked_secrets(url)
    assert found[0] == url
    assert {token, uuid, f"a%2Fb{token}", f"a/b{token}"} <= set(found)
    assert set(found) == {url, token, uuid, f"a%2Fb{token}", f"a/b{token}"}


@pytest.mark.parametrize(
    "url",
    [
        "https://api.groq.com/openai/v1",
        "https://generativelanguage.googleapis.com/v1beta/openai",
        "https://x.openai.azure.com/openai/deployments/gpt-4o-mini-2024-07-18",
        "https://internationalization.example/v1",  # a long word, no digit
    ],
)
def test_names_in_a_secret_url_are_no_tokens(url: str) -> None:
    """Hidden in every log and answer, they garbled them (a review)."""
    assert unmarked_secrets(url) == (url,)


def test_a_user_name_without_a_password_is_the_secret() -> None:
    assert set(url_secrets(f"https://{KEY}@h/v1")) == {KEY, f"{KEY}:"}


def test_url_credentials_are_decoded_and_absent_without_userinfo() -> None:
    assert url_credentials("https://us%40er:p%3Ass@h/v1") == ("us@er", "p:ss")
    assert url_credentials(f"https://{KEY}@h/v1") == (KEY, "")
    assert url_credentials(f"https://h/v1?key={KEY}") is None


def test_a_url_with_no_secret_stays_a_string_and_one_with_some_is_a_secret() -> None:
    plain = "https://api.example/v1?api-version=1"
    assert guarded_url(plain) == plain
    assert isinstance(guarded_url(plain), str)
    guarded = guarded_url(f"https://api.example/v1?key={KEY}")
    assert isinstance(guarded, Secret)
    assert reveal(guarded) == f"https://api.example/v1?key={KEY}"
    assert shown(guarded) == "https://api.example/v1?key=***"
    assert repr(guarded) == "Secret('https://api.example/v1?key=***')"
    assert KEY not in f"{guarded} {guarded!r} {[guarded]}"


def test_a_url_declared_secret_with_no_known_secret_part_shows_nothing() -> None:
    s = Secret.of_url(f"https://h/bot{KEY}/v1")
    assert repr(s) == str(s) == "Secret('***')"
    assert s.reveal() == f"https://h/bot{KEY}/v1"


def test_a_secret_shows_as_stars_and_compares_by_value() -> None:
    assert repr(Secret(KEY)) == "Secret('***')"
    assert Secret(KEY, shown="x") == Secret(KEY)
    assert Secret(KEY) != KEY
    assert reveal(KEY) == shown(KEY) == KEY


def test_an_error_quotes_a_short_value_whole_and_a_long_one_by_its_start_and_length() -> None:
    assert quoted("bad name") == "'bad name'"
    assert quoted(7) == "7"
    key = "sk-proj-" + "x" * 40
    assert quoted(key) == "'sk-pro'... (48 characters)"
