"""The daemon's fetch-table cache (WeightService::LookupFetchCache): a repeated
request is answered from a cached table, and never with stale bytes — not
after a reload under the same name (same generation number), not after the materializer evicted the table's segments under the
memory budget (the cache holds them weakly, so the eviction frees memory).
An apply makes a new generation number and so new entries (test_live_swap).
PyTorch is the reference for every byte."""
import os

import torch

import harness
import st_io
import weightd


def _save(root, name, seed, rows=64, cols=32):
    g = torch.Generator().manual_seed(seed)
    sd = {"a": torch.randn(rows, cols, generator=g), "b": torch.randn(rows, generator=g)}
    path = os.path.join(root, name)
    st_io.save(sd, path)
    return path, sd


def _expect(client, model, sd, world, rank, dtype=None):
    with client.fetch(model, world, rank, dtype=dtype) as h:
        got = {k: v.clone() for k, v in h.state_dict().items()}
        lease = h._lease.lease_id
    for k, v in sd.items():
        want = torch.chunk(v if dtype is None else v.to(getattr(torch, dtype)), world)[rank]
        assert torch.equal(got[k], want), (model, k, world, rank, dtype)
    return lease


def test_repeated_fetches_and_a_reload_serve_fresh_bytes(tmp_path):
    root = str(tmp_path / "models")
    os.makedirs(root)
    p1, sd1 = _save(root, "one.safetensors", 1)
    p2, sd2 = _save(root, "two.safetensors", 2)
    with harness.Daemon(model_root=root, workdir=str(tmp_path / "d")) as d:
        c = weightd.Client(d.socket, retry_deadline=0)
        c.load("m", p1)
        leases = {_expect(c, "m", sd1, 4, 1, "float16") for _ in range(3)}
        assert len(leases) == 3  # one lease each, from one cached table
        assert c.stats()["leases_open"] == 0
        # Same name, same generation number (1), other content.
        c.unload("m")
        c.load("m", p2)
        assert c.info("m").generation == 1
        _expect(c, "m", sd2, 4, 1, "float16")
        _expect(c, "m", sd2, 4, 1)
        # A different request on the same generation is its own entry.
        _expect(c, "m", sd2, 2, 0, "float16")


def test_eviction_under_the_budget_is_not_defeated_by_the_cache(tmp_path):
    """The f16 casts of a 2 MiB model take 1 MiB of materialized segments;
    with a 4.5 MiB budget a second 2 MiB checkpoint only fits once the
    (unleased) casts are evicted. If the cache kept them alive the load would
    fail."""
    root = str(tmp_path / "models")
    os.makedirs(root)
    p1, sd1 = _save(root, "one.safetensors", 3, rows=1024, cols=511)
    p2, sd2 = _save(root, "two.safetensors", 4, rows=1024, cols=511)
    budget = int(4.5 * (1 << 20))
    with harness.Daemon(model_root=root, workdir=str(tmp_path / "d"),
                        extra_args=["--host-memory-bytes", str(budget)]) as d:
        c = weightd.Client(d.socket, retry_deadline=0)
        c.load("one", p1)
        _expect(c, "one", sd1, 1, 0, "float16")
        _expect(c, "one", sd1, 1, 0, "float16")  # from the cache
        assert c.stats()["materialization_bytes"] > 0
        c.load("two", p2)  # evicts the unleased casts
        assert c.stats()["materialization_bytes"] == 0
        _expect(c, "two", sd2, 1, 0)
        # The evicted entry misses and is rebuilt (it fits again once "two"
        # is gone), with the right bytes.
        c.unload("two")
        _expect(c, "one", sd1, 1, 0, "float16")
        assert c.stats()["leases_open"] == 0
