"""The tpu_sync P/D transfer backend in real SGLang engines on 127.0.0.1
(``--disaggregation-transfer-backend tpu_sync``): one TP=1 decode engine receives KV from a TP=1
prefill engine and from a TP=2 prefill engine (resharded: each decode rank gathers the KV heads
of both prefill ranks), token-identical to the reference engine; then the TP=1 prefill is
killed while the decode engine waits for a request's KV, and that request fails explicitly
instead of decoding from unwritten pages."""

import pytest

from engines import toks

PAGES = {0: 19, 1: 21}  # pages of A[0] (297 tokens) and A[1] (330 tokens)
PAGE_BYTES = 16 * 2 * 32 * 4  # one page of one K or V buffer (page 16, 2 KV heads of 32, f32)


@pytest.fixture(scope="module")
def pd(launched):
    """The decode engine's results (its fifth request X was announced to the TP=1 prefill,
    which :func:`engines.launch` kills as soon as X's metadata reached it)."""
    e = launched
    d = e.finish("pd-decode")
    open(e.path("pd-prefill2.release"), "w").close()
    step = next(i for i, s in enumerate(d["steps"]) if "outputs" in s)
    return dict(ref=e.finish("direct"), decode=d, engines=e, out=d["steps"][step]["outputs"],
                toks=toks(d, step))


def test_tp1_to_tp1(pd):
    out = pd["out"]
    assert [o.get("error") for o in out[:2]] == [None, None], out[:2]
    assert pd["toks"][:2] == toks(pd["ref"], 0)
    assert "pd-prefill1" in pd["engines"].killed, "the TP=1 prefill was not killed"
    (p1,) = pd["engines"].killed["pd-prefill1"]["stats"]["pd-prefill"]
    assert p1["tp_size"] == 1 and p1["registrations"] >= 2, p1
    # Every layer's K and V of both requests was staged by the prefill.
    assert p1["registered_bytes"] >= (PAGES[0] + PAGES[1]) * 4 * PAGE_BYTES, p1


def test_tp2_prefill_to_tp1_decode_is_resharded(pd):
    out = pd["out"]
    assert [o.get("error") for o in out[2:4]] == [None, None], out[2:4]
    assert pd["toks"][2:4] == toks(pd["ref"], 0)
    p2 = pd["engines"].finish("pd-prefill2")
    ranks = sorted(p2["stats"]["pd-prefill"], key=lambda s: s["tp_rank"])
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
    assert "pd-prefill1" in pd["engines"].killed, "the TP=1 prefill was not killed"
    x = pd["out"][4]
    # The request ended in an explicit failure, with no tokens, because the decode engine lost
    # its prefill (heartbeats), not because it gave up waiting
    # (SGLANG_DISAGGREGATION_WAITING_TIMEOUT).
    assert x.get("error") is not None and not x.get("output_ids"), x
    assert "Lost connection with prefill" in x["error"], x
    (dec,) = pd["decode"]["stats"]["pd-decode"]
    assert dec["pull_failures"] == 0 and dec["pulls"] == 4 and dec["failures"] == 0, dec
