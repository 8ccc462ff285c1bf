"""The tpu_sync P/D transfer backend in real SGLang engines on 127.0.0.1
(``--disaggregation-transfer-backend tpu_sync``): one TP=1 decode engine receives KV from a TP=1
prefill engine and from a TP=2 prefill engine (resharded: each decode rank gathers the KV heads
of both prefill ranks), token-identical to the reference engine; then the TP=1 prefill is
killed while the decode engine waits for a request's KV, and that request fails explicitly
instead of decoding from unwritten pages."""

import os

import pytest

from engines import toks, wait_for

PAGES = {0: 19, 1: 21}  # pages of A[0] (297 tokens) and A[1] (330 tokens)
PAGE_BYTES = 16 * 2 * 32 * 4  # one page of one K or V buffer (page 16, 2 KV heads of 32, f32)


def _meta_received(e, tag):
    st = e.stats(tag)["pd-prefill"]
    return sum(s.get("meta_received", 0) for s in st)


@pytest.fixture(scope="module")
def pd(launched):
    e = launched
    # The TP=1 prefill served its two requests; the decode engine also announced request X to
    # it (its third metadata message). Then it dies.
    wait_for(lambda: os.path.exists(e.path("pd-prefill1.done")), "the TP=1 prefill to serve its requests")
    wait_for(lambda: _meta_received(e, "pd-prefill1") >= 3, "the decode engine to announce request X")
    p1 = e.stats("pd-prefill1")["pd-prefill"]
    e.kill("pd-prefill1")
    d = e.finish("pd-decode")
    open(e.path("pd-prefill2.release"), "w").close()
    p2 = e.finish("pd-prefill2")
    return dict(ref=e.finish("direct"), decode=d, p1=p1, p2=p2["stats"]["pd-prefill"])


def test_tp1_to_tp1(pd):
    out = pd["decode"]["steps"][0]["outputs"]
    assert [o.get("error") for o in out[:2]] == [None, None], out[:2]
    assert toks(pd["decode"], 0)[:2] == toks(pd["ref"], 0)
    (p1,) = pd["p1"]
    assert p1["tp_size"] == 1 and p1["registrations"] >= 2, p1
    # Every layer's K and V of both requests was staged by the prefill.
    assert p1["registered_bytes"] >= (PAGES[0] + PAGES[1]) * 4 * PAGE_BYTES, p1


def test_tp2_prefill_to_tp1_decode_is_resharded(pd):
    out = pd["decode"]["steps"][0]["outputs"]
    assert [o.get("error") for o in out[2:4]] == [None, None], out[2:4]
    assert toks(pd["decode"], 0)[2:4] == toks(pd["ref"], 0)
    ranks = sorted(pd["p2"], key=lambda s: s["tp_rank"])
    assert [s["tp_rank"] for s in ranks] == [0, 1] and all(s["tp_size"] == 2 for s in ranks), ranks
    # Each prefill rank holds one of the two KV heads: it staged half of every page.
    for s in ranks:
        assert s["registrations"] == 2, s
        assert s["registered_bytes"] == (PAGES[0] + PAGES[1]) * 4 * PAGE_BYTES // 2, s
    (dec,) = pd["decode"]["stats"]["pd-decode"]
    assert dec["tp_size"] == 1 and dec["pulls"] == 4, dec
    # The decode rank wrote every page of the four requests into its device pool, verified.
    assert dec["pull_bytes"] == 2 * (PAGES[0] + PAGES[1]) * 4 * PAGE_BYTES, dec
    assert dec["endpoint"]["checksum_failures"] == 0, dec


def test_killed_prefill_fails_the_request(pd):
    x = pd["decode"]["steps"][0]["outputs"][4]
    # The request ended (the decode engine did not hang) and ended in a failure, with no tokens.
    failed = x.get("error") is not None or "abort" in str(x.get("finish_reason", "")).lower()
    assert failed, x
    assert not x.get("output_ids"), x
    (dec,) = pd["decode"]["stats"]["pd-decode"]
    assert dec["pull_failures"] == 0 and dec["pulls"] == 4 and dec["failures"] == 0, dec
