"""The wire: sans-IO translations between callboard's requests and results and each
provider dialect's bodies and stream events (pure functions, no sockets, no clock)."""
