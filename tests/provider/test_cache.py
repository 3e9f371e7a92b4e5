"""The simulated prompt cache (provider/cache.py), on a fake clock."""

from __future__ import annotations

from callboard.provider.cache import CAPACITY, TTL_S, PromptCache, prefix_key


def test_a_prefix_is_read_after_its_first_sight_until_it_expires() -> None:
    cache = PromptCache()
    key = prefix_key(["system", "long document"])
    assert not cache.lookup(key, 0.0)  # written
    assert cache.lookup(key, 1.0)  # read, and its lifetime starts again
    assert cache.lookup(key, 1.0 + TTL_S)
    assert not cache.lookup(key, 2.0 + 2 * TTL_S)  # forgotten, written again
    assert prefix_key(["system", "long document"]) == key != prefix_key(["other"])


def test_the_least_recently_used_prefix_goes_first() -> None:
    cache = PromptCache()
    keys = [prefix_key(i) for i in range(CAPACITY + 1)]
    for key in keys[:CAPACITY]:
        cache.lookup(key, 0.0)
    assert cache.lookup(keys[0], 0.0)  # keys[0] is now the most recent
    cache.lookup(keys[CAPACITY], 0.0)  # pushes out keys[1]
    assert cache.lookup(keys[0], 0.0)
    assert not cache.lookup(keys[1], 0.0)
