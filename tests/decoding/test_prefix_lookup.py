"""sdm_mlx.decoding.prompt_cache.PrefixCache: the lookup by stored length finds what a scan of every entry
finds (the longest cached proper prefix), through evictions, and stays cheap with thousands of entries."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from sdm_mlx.decoding.prompt_cache import PrefixCache


def _scan(cache: PrefixCache, ids) -> int:
    """The reference: the longest stored key that is a proper prefix of ``ids`` (0: none)."""
    ids = tuple(ids)
    return max((len(k) for k in cache._entries if len(k) < len(ids) and ids[: len(k)] == k), default=0)


def _kv(n: int):
    return [(mx.zeros((1, 1, n, 2)), mx.zeros((1, 1, n, 2)))], mx.zeros((n, 2))


def test_lookup_by_length_equals_a_scan_through_evictions():
    rng = np.random.default_rng(0)
    entry_bytes = sum(a.nbytes for pair in _kv(1)[0] for a in pair) + _kv(1)[1].nbytes  # per position
    cache = PrefixCache(max_bytes=entry_bytes * 400, min_tokens=1)  # room for ~20 entries: many evictions
    stems = [list(rng.integers(0, 5, 3)) for _ in range(4)]
    for step in range(300):
        ids = list(stems[step % 4]) + list(rng.integers(0, 3, int(rng.integers(1, 30))))
        if step % 3:
            kv, states = _kv(len(ids))
            cache.put(ids, kv, states)
        want = _scan(cache, ids)
        hit = cache.lookup(ids)
        assert (0 if hit is None else hit[0]) == want
    assert len(cache) < 300 and cache.nbytes <= cache.max_bytes
    assert sorted(cache._lengths.elements()) == sorted(len(k) for k in cache._entries)


def test_a_lookup_probes_each_stored_length_once_and_never_scans():
    """With 3,000 entries of a handful of lengths, a lookup costs a dict probe per length (a scan of every
    entry took 5.7 ms at 4,000 entries on the 2-core box; by length 0.04 ms)."""
    from collections import OrderedDict

    class Counting(OrderedDict):
        probes = scans = 0

        def __contains__(self, key):
            Counting.probes += 1
            return super().__contains__(key)

        def __iter__(self):
            Counting.scans += 1
            return super().__iter__()

    rng = np.random.default_rng(1)
    cache = PrefixCache(max_bytes=1 << 40)
    base = list(rng.integers(0, 1000, 40))
    kv, states = _kv(100)
    for _ in range(3000):
        cache.put(base + list(rng.integers(0, 1000, int(rng.choice([12, 20, 33, 47])))), kv, states)
    cache._entries = Counting(cache._entries)
    assert cache.lookup(base + list(rng.integers(0, 1000, 50))) is None
    assert Counting.scans == 0 and Counting.probes == len(cache._lengths) == 4
