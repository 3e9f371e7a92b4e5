"""The settings the actors run with (core/settings.py): ``Secret``, ``Timeouts``,
``ModelSettings`` and ``SchedulerSettings``, validated on construction; an API key or
a proxy never shows in a repr, an error or a log record."""

from __future__ import annotations

import logging
import re
from decimal import Decimal
from typing import Any

import pytest
from callboard.core.pricing import Price, cost_nusd
from callboard.core.retry import RetryConfig
from callboard.core.routing import RoutingPolicy
from callboard.core.secret import reveal
from callboard.core.settings import (
    FREE,
    ModelSettings,
    SchedulerSettings,
    Secret,
    Timeouts,
)
from callboard.messages import ConfigError, Request, Usage
from callboard.provider.server import SimulatedProvider
from support import WAIT_S, one_model

from callboard import System, SystemConfig

URL = "http://127.0.0.1:9/v1"
KEY = "sk-live-abcdef0123456789"


def model(**kw: Any) -> ModelSettings:
    return ModelSettings(**{"name": "a", "base_url": URL, **kw})


# -- Secret -------------------------------------------------------------------------------


def test_a_secret_prints_as_stars_and_reveals_its_value() -> None:
    s = Secret(KEY)
    assert repr(s) == str(s) == "Secret('***')"
    assert f"{s}" == "Secret('***')"
    assert s.reveal() == KEY


def test_secrets_compare_and_hash_by_value() -> None:
    assert Secret(KEY) == Secret(KEY)
    assert Secret(KEY) != Secret(KEY + "x")
    assert Secret(KEY) != KEY  # never equal to the bare string
    assert len({Secret(KEY), Secret(KEY)}) == 1


def test_a_plain_string_api_key_never_appears_in_a_repr() -> None:
    refused: ConfigError | None = None
    try:
        settings_ = ModelSettings(name="a", base_url=URL, api_key=KEY)
    except ConfigError as exc:  # refusing it is fine, as long as the error hides it
        refused = exc
    if refused is not None:
        assert KEY not in str(refused)
        return
    assert KEY not in repr(settings_)
    assert KEY not in repr(SystemConfig(models=(settings_,)))
    assert isinstance(settings_.api_key, Secret)


def test_a_secret_api_key_never_appears_in_a_repr() -> None:
    s = ModelSettings(name="a", base_url=URL, api_key=Secret(KEY))
    assert KEY not in repr(s)
    assert KEY not in repr(SystemConfig(models=(s,)))


def test_an_unsendable_plain_key_is_refused_unseen() -> None:
    for bad in (KEY + "\n", KEY[:5] + " " + KEY[5:], ""):
        with pytest.raises(ConfigError) as info:
            ModelSettings(name="a", base_url=URL, api_key=Secret(bad))
        assert KEY[:8] not in str(info.value)
    with pytest.raises(ConfigError, match="api_key"):
        ModelSettings(name="a", base_url=URL, api_key=b"sk-bytes")  # type: ignore[arg-type]


def test_a_key_typed_in_the_wrong_field_is_not_quoted_whole_by_its_error() -> None:
    """A key pasted as a header's name or as ``provider_model`` was quoted in full by
    the error that refused it, and by every log that printed the error (a hunt)."""
    with pytest.raises(ConfigError) as named:
        ModelSettings(name="a", base_url=URL, headers={KEY + " x": "v"})
    with pytest.raises(ConfigError) as wired:
        ModelSettings(name="a", base_url=URL, provider_model=KEY + "\n")
    for error in (named, wired):
        assert KEY[8:] not in str(error.value)
        assert "characters)" in str(error.value)
    with pytest.raises(ConfigError, match="'bad name' is not an HTTP header name"):
        ModelSettings(name="a", base_url=URL, headers={"bad name": "v"})  # short: quoted whole


def test_an_unsendable_api_key_never_reaches_a_log_record(
    provider: SimulatedProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "sk-hunt-0123456789-SECRETVALUE"  # noqa: S105 - a fake key to look for
    try:
        settings = one_model(
            provider,
            api_key=Secret(secret + "\n"),  # a trailing newline from a .env file
            transport="httpx",
            retry=RetryConfig(max_attempts=1),
        )
    except ConfigError as exc:  # refusing it is fine, if the refusal does not show it
        refusal: str | None = str(exc)
    else:
        refusal = None
    if refusal is not None:
        assert "SECRETVALUE" not in refusal
        return
    with System(SystemConfig(models=(settings,))) as system:
        result = system.submit("hi").result(WAIT_S)
    assert not result.ok
    assert "SECRETVALUE" not in repr(result) + str(getattr(result, "detail", ""))
    leaks = [r.name for r in caplog.records if "SECRETVALUE" in r.getMessage()]
    assert leaks == []


def test_a_proxy_is_a_secret_and_needs_the_httpx_transport() -> None:
    settings = model(
        base_url="http://127.0.0.1:1/v1", transport="httpx", proxy="http://u:pw@proxy:3128"
    )
    assert "pw@proxy" not in repr(settings)
    assert isinstance(settings.proxy, Secret)
    with pytest.raises(ConfigError, match="transport"):
        model(base_url="http://127.0.0.1:1/v1", proxy="http://proxy:3128")


def test_a_proxy_must_be_an_http_url_and_its_error_hides_it() -> None:
    with pytest.raises(ConfigError, match="proxy must be an http") as info:
        model(transport="httpx", proxy="socks5://u:pw@proxy:1080")
    assert "pw" not in str(info.value)
    with pytest.raises(ConfigError, match="proxy must be a URL string"):
        model(transport="httpx", proxy=3128)


def test_a_proxy_shows_its_host_but_not_its_password() -> None:
    settings = model(transport="httpx", proxy=f"http://bob:{KEY}@proxy:3128")
    assert "proxy=Secret('http://bob:***@proxy:3128')" in repr(settings)
    assert KEY not in repr(settings)


def test_a_base_url_with_a_key_in_its_query_is_a_secret_shown_masked() -> None:
    settings = model(base_url=f"https://api.example/v1?api-version=1&key={KEY}")
    assert isinstance(settings.base_url, Secret)
    assert settings.base_url.reveal() == f"https://api.example/v1?api-version=1&key={KEY}"
    assert "base_url=Secret('https://api.example/v1?api-version=1&key=***')" in repr(settings)
    assert KEY not in repr(SystemConfig(models=(settings,)))


def test_a_base_url_with_credentials_is_a_secret_and_excludes_an_api_key() -> None:
    settings = model(base_url=f"https://bob:{KEY}@api.example/v1")
    assert isinstance(settings.base_url, Secret)
    assert KEY not in repr(settings)
    with pytest.raises(ConfigError, match="not both") as info:
        model(base_url=f"https://bob:{KEY}@api.example/v1", api_key="sk-other-0123456789")
    assert KEY not in str(info.value)


def test_a_base_url_with_nothing_secret_stays_a_string() -> None:
    assert model(base_url="https://api.example/v1?api-version=1").base_url == (
        "https://api.example/v1?api-version=1"
    )


def test_a_base_url_given_as_a_secret_is_kept_as_given() -> None:
    url = Secret(f"https://api.example/bot{KEY}/v1")
    settings = model(base_url=url)
    assert settings.base_url is url
    assert KEY not in repr(settings)


@pytest.mark.parametrize("url", [f"ftp://api.example/?key={KEY}", f"ftp://u:{KEY}@api.example/"])
def test_a_base_url_refused_for_its_scheme_is_shown_masked(url: str) -> None:
    with pytest.raises(ConfigError, match="base_url must be http") as info:
        model(base_url=url)
    assert KEY not in str(info.value)
    assert "api.example" in str(info.value)


@pytest.mark.parametrize(
    "url", [f"https://h.example:0/v1/bot{KEY}", f"ftp://h.example/bot{KEY}", f"https://[h/{KEY}"]
)
def test_a_base_url_given_as_a_secret_and_refused_shows_none_of_it(url: str) -> None:
    """Marked secret whole (a key in its path): refused for its port, its scheme or its
    host, the error shows it as the secret shows, not merely masked as a URL (found by
    a hunt)."""
    with pytest.raises(ConfigError, match="base_url") as info:
        model(base_url=Secret(url))
    assert KEY not in str(info.value)
    assert "h.example" not in str(info.value)


def test_http2_without_the_h2_package_is_refused_at_configuration() -> None:
    try:
        import h2  # noqa: F401
    except ImportError:
        pass
    else:  # pragma: no cover - with h2 installed http2 can work
        pytest.skip("h2 is installed")
    started: list[System] = []
    config = {"base_url": "https://127.0.0.1:1/v1", "transport": "httpx", "http2": True}
    try:
        with pytest.raises(ConfigError):
            started.append(System(SystemConfig(models=(model(**config),))))
    finally:
        for system in started:
            system.stop(timeout=10)


def test_http2_needs_the_httpx_transport() -> None:
    with pytest.raises(ConfigError, match="http2 needs transport"):
        model(http2=True)


# -- Timeouts -----------------------------------------------------------------------------


def test_timeouts_default_and_accept_positive_numbers() -> None:
    assert Timeouts() == Timeouts(connect=5.0, read=60.0, total=120.0)
    assert Timeouts(connect=1, read=0.5, total=2).read == 0.5


@pytest.mark.parametrize("which", ["connect", "read", "total"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "5", True])
def test_a_timeout_must_be_a_positive_finite_number(which: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"timeout.{which}"):
        Timeouts(**{which: value})


# -- ModelSettings ------------------------------------------------------------------------


def test_model_defaults_are_free_unlimited_and_send_max_tokens() -> None:
    m = model()
    assert m.price == FREE
    assert (m.limiter.rpm, m.limiter.tpm) == (None, None)
    assert m.max_tokens_param == "max_tokens"
    assert m.wire_model == "a"
    assert model(provider_model="org/llama-3").wire_model == "org/llama-3"


@pytest.mark.parametrize(
    "name", ["", None, 7, 'evil"} 9\nfake_metric 1', "a\rb", "tab\there", " gpt", "gpt "]
)
def test_a_model_needs_a_name_it_can_be_shown_by(name: Any) -> None:
    """A model's name goes into answers' ``X-Callboard-Model`` header, logs and metrics:
    with a line break in it every answer it served was dropped mid-write (the HTTP
    server refuses such a header) while the metrics counted it a success."""
    with pytest.raises(ConfigError, match="model name"):
        ModelSettings(name=name, base_url=URL)


@pytest.mark.parametrize("url", ["ftp://x/v1", "127.0.0.1:9/v1", "", None])
def test_base_url_must_be_http(url: Any) -> None:
    with pytest.raises(ConfigError, match="base_url"):
        ModelSettings(name="a", base_url=url)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:99999/v1", "http://:9/v1", "http://h:0/v1", "https://h:x/v1"]
)
def test_a_base_url_without_a_host_or_with_no_port_is_refused_at_once(url: str) -> None:
    """Every call to it would fail after its retries, blamed on the provider
    (``malformed_response``, or a misleading ``connection refused``)."""
    with pytest.raises(ConfigError, match="needs a host and, if it gives one, a port"):
        ModelSettings(name="a", base_url=url)
    assert ModelSettings(name="a", base_url="http://[::1]:8080/v1").base_url


@pytest.mark.parametrize(
    "proxy",
    ["http://127.0.0.1:99999", "http://:3128", "http://127.0.0.1:0", "http://", "http://p:x"],
)
def test_a_proxy_without_a_host_or_with_no_port_is_refused_at_once(proxy: str) -> None:
    """A typo in it failed every call as a connection error, blamed on the provider, its
    breaker opened and the model given up on (found by a hunt)."""
    with pytest.raises(ConfigError, match="proxy needs a host and, if it gives one, a port"):
        ModelSettings(name="a", base_url=URL, transport="httpx", proxy=proxy)


@pytest.mark.parametrize("field", ["base_url", "proxy"])
@pytest.mark.parametrize("end", ["\n", "\r\n", " ", "\t"])
def test_a_url_with_a_line_end_an_env_file_left_is_refused_at_once(field: str, end: str) -> None:
    """``base_url_env`` or ``proxy_env`` from a CRLF .env file: accepted at load, it failed
    at start, after ``callboard run`` had made its ledger, naming neither (a hunt)."""
    url = "http://user:hunter2pw@127.0.0.1:3128" + end
    fields: dict[str, Any] = {"base_url": url} if field == "base_url" else {"proxy": url}
    if field == "proxy":
        fields |= {"base_url": URL, "transport": "httpx"}
    with pytest.raises(ConfigError, match=f"{field} holds white space") as info:
        ModelSettings(name="a", **fields)
    assert "hunter2pw" not in str(info.value)


def test_an_anthropic_model_reads_and_writes_its_cache_at_anthropics_prices_unless_told() -> None:
    price = Price("3", "15")
    claude = ModelSettings(name="c", base_url=URL, api="anthropic", price=price)
    assert claude.price.cached_input_per_mtok == Decimal("0.3")  # reads: 0.1x input
    assert claude.price.cache_write_per_mtok == Decimal("3.75")  # 1.25x input
    assert claude.price.cache_write_1h_per_mtok == Decimal(6)  # the 1-hour cache: 2x
    # a prompt mostly read from the cache is charged what Anthropic bills: 100,000 cached
    # tokens at $0.30 a million, 10 others at $3, 10 out at $15 (it was $0.30018: every
    # cached token at the whole input price; found by a hunt)
    usage = Usage(prompt_tokens=100_010, completion_tokens=10, cached_tokens=100_000)
    assert cost_nusd(claude.price, usage) == 30_180_000
    told = Price("3", "15", "0.5", cache_write_per_mtok="4", cache_write_1h_per_mtok="7")
    assert ModelSettings(name="c", base_url=URL, api="anthropic", price=told).price == told
    partly = ModelSettings(
        name="c", base_url=URL, api="anthropic", price=Price("3", "15", cache_write_per_mtok="4")
    ).price
    assert (partly.cached_input_per_mtok, partly.cache_write_per_mtok) == (Decimal("0.3"), 4)
    assert ModelSettings(name="g", base_url=URL, price=price).price == price  # OpenAI's: as given


def test_an_anthropic_model_without_a_price_stays_unpriced() -> None:
    """Given Anthropic's cache prices, no price became a price of zeros: its calls were
    shown as costing $0, not unknown, and no budget warned of it (found by a hunt)."""
    assert ModelSettings(name="c", base_url=URL, api="anthropic").price is FREE


@pytest.mark.parametrize("field", ["max_concurrency", "context_window"])
def test_a_bool_is_no_count(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelSettings(name="a", base_url=URL, **{field: True})


@pytest.mark.parametrize("value", [0, -3, 2.5, "8"])
def test_a_count_is_an_integer_of_at_least_one(value: Any) -> None:
    with pytest.raises(ConfigError, match="max_concurrency"):
        model(max_concurrency=value)


def test_collections_are_normalised_in_order() -> None:
    m = model(capabilities=["vision", "json"], tiers=["fast", "cheap"], fallbacks=["b", "c"])
    assert m.capabilities == frozenset({"vision", "json"})
    assert m.tiers == ("fast", "cheap")
    assert m.fallbacks == ("b", "c")


def test_capabilities_given_as_a_list_are_refused_or_work() -> None:
    try:
        m = ModelSettings(name="a", base_url=URL, capabilities=["vision"])  # type: ignore[arg-type]
    except ConfigError:
        return
    plan = RoutingPolicy({m.name: m}).plan(
        Request.of("hello there", metadata={"capabilities": ["vision"]}), 10
    )
    assert plan.candidates == ("a",)


def test_tiers_given_as_a_string_are_refused_or_work() -> None:
    try:
        m = ModelSettings(name="a", base_url=URL, tiers="fast")  # type: ignore[arg-type]
    except ConfigError:
        return
    p = RoutingPolicy({m.name: m})
    assert "fast" in p.routes
    assert "f" not in p.routes


@pytest.mark.parametrize("field", ["capabilities", "tiers", "fallbacks"])
@pytest.mark.parametrize("value", ["fast", ["ok", ""], [3], 5])
def test_a_bare_string_or_a_bad_name_is_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        model(**{field: value})


def test_a_model_may_not_fall_back_on_itself() -> None:
    with pytest.raises(ConfigError, match="itself"):
        model(fallbacks=("a",))


@pytest.mark.parametrize(
    ("field", "value"),
    [("transport", "requests"), ("max_tokens_param", "max_output_tokens")],
)
def test_a_choice_outside_its_set_is_refused(field: str, value: str) -> None:
    with pytest.raises(ConfigError, match=field):
        model(**{field: value})


def test_settings_are_frozen() -> None:
    m = model(price=Price(Decimal(1), Decimal(2)))
    with pytest.raises(AttributeError):
        m.name = "b"  # type: ignore[misc]


# -- SchedulerSettings --------------------------------------------------------------------


def test_scheduler_defaults() -> None:
    s = SchedulerSettings()
    assert (s.capacity, s.aging_step_s, s.escalate_margin_s) == (100_000, 10.0, 1.0)
    assert SchedulerSettings(aging_step_s=None).aging_step_s is None
    assert SchedulerSettings().aging_share == 0.1


@pytest.mark.parametrize("share", ["0.1", 0, -0.5, 0.7, 1.5, 1e-17, float("nan"), True])
def test_aging_share_must_be_more_than_0_and_at_most_1(share: Any) -> None:
    with pytest.raises(ConfigError, match="aging_share"):
        SchedulerSettings(aging_share=share)


@pytest.mark.parametrize("step", ["10", float("inf"), float("nan"), True, 0])
def test_aging_step_must_be_a_positive_finite_number(step: Any) -> None:
    with pytest.raises(ConfigError, match="aging_step_s"):
        SchedulerSettings(aging_step_s=step)


def test_a_bool_capacity_is_refused() -> None:
    with pytest.raises(ConfigError, match="capacity"):
        SchedulerSettings(capacity=True)


@pytest.mark.parametrize("margin", [-0.1, float("inf"), float("nan"), True, "1"])
def test_escalate_margin_must_be_a_finite_number_of_at_least_zero(margin: Any) -> None:
    with pytest.raises(ConfigError, match="escalate_margin_s"):
        SchedulerSettings(escalate_margin_s=margin)
    assert SchedulerSettings(escalate_margin_s=0).escalate_margin_s == 0


def test_tenant_weights_are_frozen_and_checked() -> None:
    s = SchedulerSettings(tenant_weights={"team-a": 3, "b": 0.5})
    assert s.tenant_weights == {"team-a": 3.0, "b": 0.5}
    assert SchedulerSettings().tenant_weights == {}
    with pytest.raises(TypeError):
        s.tenant_weights["c"] = 1.0  # type: ignore[index]


@pytest.mark.parametrize(
    ("weights", "needle"),
    [
        ({"a": 0}, "tenant 'a' must weigh a positive finite number"),
        ({"a": float("inf")}, "tenant 'a' must weigh"),
        ({"a": float("nan")}, "tenant 'a' must weigh"),
        ({"a": True}, "tenant 'a' must weigh"),
        ({"a": "3"}, "tenant 'a' must weigh"),
        ({"": 1}, "a tenant must be a non-empty string"),
        ({1: 1}, "a tenant must be a non-empty string"),
        (["a"], "must be a table of tenant = weight"),
    ],
)
def test_a_bad_tenant_weight_is_refused_naming_it(weights: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        SchedulerSettings(tenant_weights=weights)


@pytest.mark.parametrize(
    ("part", "value"),
    [
        ("price", {"input": "0.15", "output": "0.60"}),  # the TOML shape, in Python
        ("price", (1, 2)),
        ("timeout", 30),  # the SDKs' spelling
        ("limiter", {"rpm": 60}),
        ("breaker", {"consecutive_failures": 3}),
        ("retry", {"max_attempts": 2}),
        ("provider_model", 5),
        ("provider_model", ""),
        ("provider_model", "a\nb"),
        ("http2", "yes"),
    ],
)
def test_a_models_part_of_the_wrong_kind_is_refused_naming_it(part: str, value: Any) -> None:
    """A price given as a dict passed, then killed the model actor on each answer it
    settled, and each restart sent the call again (paid each time)."""
    with pytest.raises(ConfigError, match=rf"model 'm': {part} must be"):
        ModelSettings(name="m", base_url="http://127.0.0.1:9", **{part: value})


def test_two_headers_whose_names_differ_only_in_case_are_refused() -> None:
    """HTTP names are not case-sensitive: ``X-B`` and ``x-b`` were both kept, and the
    last one sent (found by a hunt)."""
    with pytest.raises(ConfigError, match="headers 'X-B' and 'x-b' are one header"):
        ModelSettings(name="m", base_url="http://127.0.0.1:9", headers={"X-B": "1", "x-b": "2"})


@pytest.mark.parametrize("name", ["Authorization", "api-key", "x-api-key", "X-Goog-Api-Key"])
def test_a_credential_header_given_plain_is_kept_secret(name: str) -> None:
    """Given as a plain string in Python, it showed in clear in every repr of the
    config (the shell's ``cb.models``, a traceback's locals)."""
    m = ModelSettings(name="m", base_url="http://127.0.0.1:9", headers={name: "sk-live-123"})
    assert isinstance(m.headers[name], Secret)
    assert reveal(m.headers[name]) == "sk-live-123"
    assert "sk-live-123" not in repr(m)
    assert (
        m.headers
        == ModelSettings(
            name="m", base_url="http://127.0.0.1:9", headers={name: Secret("sk-live-123")}
        ).headers
    )


@pytest.mark.parametrize(
    ("api", "refunds"), [("openai", False), ("azure", False), ("anthropic", True)]
)
def test_only_anthropics_token_limit_gives_back_what_a_call_did_not_use(
    api: str, refunds: bool
) -> None:
    settings = ModelSettings(name="m", base_url="http://127.0.0.1:9/v1", api=api)  # type: ignore[arg-type]
    assert settings.refunds_tokens is refunds
