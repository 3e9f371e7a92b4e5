"""The simulated provider's HTTP application (provider/app.py): it serves loopback only."""

from __future__ import annotations

import pytest
from callboard.provider.app import check_loopback


@pytest.mark.parametrize("host", ["127.0.0.1.5", "127.300.0.1"])
def test_loopback_check_refuses_what_is_not_an_ip_literal(host: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        check_loopback(host)
