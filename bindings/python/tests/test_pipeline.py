"""Failure semantics and the staging budget through the Python API: a pull to the wrong
address, then the right one, is byte-exact; a reject frees the producer's staging at once and
says ``rejected``; a registration past the staging budget fails with ``StagingExhaustedError``
while earlier ones still pull byte-exact; a pull that reaches the producer before its
registration waits for it; the DMA map is attempted for every staging and reported. One
process, two endpoints over loopback TCP, the real XLA CPU plugin."""

import os
import sys
import time

import pytest

import tpu_sync
from tpu_sync import errors

from test_validation import DST, SRC, TOKENS, expected_after_pull, layers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests", "cluster_util"))
import ports  # noqa: E402

BYTES = TOKENS * 2 * 2 * 8 * 2 * 2  # request bytes: tokens x planes x heads x head_dim x bf16 x layers


def in_use(stats):
    """Budget bytes held by live operations: the budget's use less the idle pooled arenas."""
    return stats["staging_budget"]["used_bytes"] - stats["staging_pool"]["idle_bytes"]


@pytest.fixture(scope="module")
def client():
    c = tpu_sync.Client(cpu_devices=1)
    yield c
    c.close()


def endpoints(**prod_kw):
    """A producer with its own staging budget (1 GiB unless given), and a consumer."""
    prod_kw.setdefault("staging_budget_bytes", 1 << 30)
    prod = tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=10, **prod_kw)
    cons = tpu_sync.Endpoint(listen=None, timeout=10)
    return prod, cons


def wait_until(cond, limit_s):
    deadline = time.monotonic() + limit_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.001)
    return cond()


def closed_port():
    """A reserved port (tests/cluster_util/ports.py): nothing listens there and nothing else
    binds it while it is held."""
    return ports.reserve()


def test_a_pull_to_the_wrong_address_then_the_right_one_is_byte_exact(client, data):
    prod, cons = endpoints()
    other = tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=10)
    try:
        src = layers(client, data, 10)
        prod.register(21, SRC, TOKENS, {0: src})
        dst = layers(client, data, 20)
        init = [b.read() for b in dst]
        with closed_port() as hole, pytest.raises(errors.TpuSyncError) as e:
            cons.pull(21, hole.addr(), SRC, DST, TOKENS, {0: dst}).wait(timeout=30)
        assert not isinstance(e.value, errors.PendingError)
        with pytest.raises(errors.UnknownRequestError):
            cons.pull(21, other.address, SRC, DST, TOKENS, {0: dst}).wait(timeout=30)
        assert prod.registration_state(21) == "active"  # the failed pulls did not consume it
        assert [b.read() for b in dst] == init  # and wrote nothing
        stats = cons.pull(21, prod.address, SRC, DST, TOKENS, {0: dst}).wait(timeout=30)
        assert stats["bytes"] == stats["device_bytes"] == BYTES
        assert [b.read() for b in dst] == expected_after_pull(src, init)
        assert wait_until(lambda: prod.registration_state(21) == "released", 10)
    finally:
        for e in (cons, prod, other):
            e.close()


def test_a_reject_frees_the_staging_at_once_and_says_rejected(client, data):
    prod, cons = endpoints()
    try:
        src = layers(client, data, 10)
        before = in_use(prod.stats())
        prod.register(22, SRC, TOKENS, {0: src})
        assert prod.stats()["staged_bytes"] > 0
        cons.reject(22, prod.address, "decode refused the request")
        assert prod.registration_state(22) == "rejected"
        assert prod.stats()["staged_bytes"] == 0
        assert wait_until(lambda: in_use(prod.stats()) == before, 0.1), \
            "the staging is freed within 100 ms"
        assert cons.stats()["rejects_sent"] == 1
        # A rejected request can no longer be pulled.
        dst = layers(client, data, 20)
        with pytest.raises(errors.TpuSyncError):
            cons.pull(22, prod.address, SRC, DST, TOKENS, {0: dst}).wait(timeout=30)
        with pytest.raises(errors.InvalidArgumentError):
            cons.reject(0, prod.address)
        with pytest.raises(errors.InvalidArgumentError):
            cons.reject(22, {})
    finally:
        cons.close()
        prod.close()


def test_past_the_staging_budget_earlier_registrations_still_pull_byte_exact(client, data):
    probe, probe_c = endpoints()
    src = layers(client, data, 10)
    probe.register(1, SRC, TOKENS, {0: src})
    one = probe.stats()["staging_budget"]["used_bytes"]
    probe.close()
    probe_c.close()
    prod, cons = endpoints(staging_budget_bytes=2 * one)
    try:
        assert prod.stats()["staging_budget"]["limit_bytes"] == 2 * one
        prod.register(31, SRC, TOKENS, {0: src})
        prod.register(32, SRC, TOKENS, {0: src})
        with pytest.raises(errors.StagingExhaustedError) as e:
            prod.register(33, SRC, TOKENS, {0: src})
        assert "budget" in e.value.message
        assert prod.registration_state(33) == "unknown"
        assert prod.stats()["staging_budget"]["refused"] == 1
        for rid in (31, 32):
            dst = layers(client, data, 40 + rid)
            init = [b.read() for b in dst]
            cons.pull(rid, prod.address, SRC, DST, TOKENS, {0: dst}).wait(timeout=30)
            assert [b.read() for b in dst] == expected_after_pull(src, init)
        assert wait_until(lambda: in_use(prod.stats()) == 0, 5)
        prod.register(33, SRC, TOKENS, {0: src})  # fits now
    finally:
        cons.close()
        prod.close()


def early_pull(prod, cons, client, data, rid, wait):
    """Source and destination layers, the destination's bytes, and a pull of ``rid`` started
    before the producer registered it (still waiting)."""
    src = layers(client, data, 10)
    dst = layers(client, data, 20)
    init = [b.read() for b in dst]
    t = cons.pull(rid, prod.address, SRC, DST, TOKENS, {0: dst}, wait_for_registration=wait)
    time.sleep(0.05)
    assert not t.done
    return src, dst, init, t


def test_a_pull_before_the_registration_waits_for_it(client, data):
    prod, cons = endpoints()
    try:
        src, dst, init, t = early_pull(prod, cons, client, data, 41, 30)
        prod.register(41, SRC, TOKENS, {0: src})
        stats = t.wait(timeout=30)
        assert stats["device_bytes"] == BYTES
        assert [b.read() for b in dst] == expected_after_pull(src, init)
        # Without the wait, the same early pull fails with the producer's typed error.
        with pytest.raises(errors.UnknownRequestError):
            cons.pull(42, prod.address, SRC, DST, TOKENS, {0: dst}, wait_for_registration=0).wait(timeout=30)
    finally:
        cons.close()
        prod.close()


def test_a_refused_request_fails_its_pulls_at_once(client, data):
    """A producer that refuses a request (its registration failed) has a pull waiting for the
    registration fail at once with the reason and its typed error, the destination untouched; a
    registered request refused ends; registering the id again serves it."""
    prod, cons = endpoints()
    try:
        src, dst, init, t = early_pull(prod, cons, client, data, 43, 600)
        assert prod.refuse(43, "staging its blocks failed") is False
        with pytest.raises(errors.CancelledError) as e:
            t.wait(timeout=30)  # not the 600 s registration wait
        assert "refused by its producer: staging its blocks failed" in e.value.message
        assert [b.read() for b in dst] == init
        with pytest.raises(errors.CancelledError):
            cons.describe(43, prod.address)
        prod.register(44, SRC, TOKENS, {0: src})
        assert prod.refuse(44) is True and prod.stats()["refusals"] == 2
        assert prod.registration_state(44) == "unregistered"
        with pytest.raises(errors.CancelledError) as e:
            cons.pull(44, prod.address, SRC, DST, TOKENS, {0: dst}, wait_for_registration=600).wait(timeout=30)
        assert e.value.message.endswith("refused by its producer: no reason given"), e.value.message
        prod.register(43, SRC, TOKENS, {0: src})
        cons.pull(43, prod.address, SRC, DST, TOKENS, {0: dst}).wait(timeout=30)
        assert [b.read() for b in dst] == expected_after_pull(src, init)
    finally:
        cons.close()
        prod.close()


def test_the_dma_map_is_attempted_and_reported(client, data):
    prod, cons = endpoints()
    try:
        src = layers(client, data, 10)
        prod.register(51, SRC, TOKENS, {0: src})
        dst = layers(client, data, 20)
        t = cons.pull(51, prod.address, SRC, DST, TOKENS, {0: dst})
        stats = t.wait(timeout=30)
        # The XLA CPU plugin answers UNIMPLEMENTED: skipped, with its reason.
        assert stats["dma_map"].startswith("skipped: UNIMPLEMENTED"), stats
        assert t.report["staged_bytes"] >= BYTES
        for ep in (prod, cons):
            s = ep.stats()
            assert s["dma_skipped"] >= 1 and "UNIMPLEMENTED" in s["dma_last"], s
        off = tpu_sync.Endpoint(listen=None, dma_map=False)
        dst2 = layers(client, data, 21)
        prod.register(52, SRC, TOKENS, {0: src})
        assert off.pull(52, prod.address, SRC, DST, TOKENS, {0: dst2}).wait(timeout=30)["dma_map"] == "disabled"
        off.close()
    finally:
        cons.close()
        prod.close()
