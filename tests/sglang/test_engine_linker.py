"""The tpu_sync unified-cache linker in real SGLang engines (``--enable-unified-cache-external-linker
--unified-cache-external-linker-backend dynamic``, no HiCache): the first engine (``linker``)
offloads every prompt's pages from its device pool straight into a ``/dev/shm`` tier; a second
engine process (``linker-restart``) re-attaches the tier, hits the first one's pages
(layer-wise loads into its device pool), and recomputes from a page corrupted in the tier
meanwhile. Every output is token-identical to the reference engine."""

import pytest

from engines import A, PAGE, details, toks


@pytest.fixture(scope="module")
def ref(launched):
    return launched.finish("direct")


def test_linker_engine_matches_and_offloads_every_page(launched, ref):
    lk = launched.finish("linker")
    assert toks(lk, 0) == toks(ref, 0)
    assert toks(lk, 1) == toks(ref, 3)
    st = lk["stats"]["linker"]
    assert len(st) == 1, st
    c = st[0]
    assert c["attach"] == "created", c
    # A[0] (18 pages), A[1] (20) and A0X's own tail (2 more after A[0]'s 18) went to the tier.
    assert c["offload_stored"] >= 18 + 20 + 2 and c["offload_failures"] == 0, c
    assert c["tier"]["dram_blocks"] >= 40, c
    assert c["pacing"]["bytes"] >= c["offload_stored"] * c["tier"]["bytes_put"] // max(1, c["tier"]["put_blocks"])


def test_second_process_hits_the_tier_and_recomputes_a_corrupted_page(restarted, ref):
    res = restarted.finish("linker-restart")
    c = res["stats"]["linker"][0]
    assert c["attach"] == "attached", c
    # A0X: every full page came from the tier written by the other process (SGLang reports a
    # linker hit as "host" tokens), loaded layer by layer into the device pool.
    d = details(res, 0)[0]
    assert d.get("host", 0) >= 18 * PAGE, d
    assert toks(res, 0) == toks(ref, 3)
    # A[1]: its page 3 was corrupted in the tier: the lookup's verified read stops there, only
    # the three pages before it are loaded, the rest is recomputed, and the output is the same.
    assert toks(res, 1) == [toks(ref, 0)[1]]
    assert details(res, 1)[0].get("host", 0) == 3 * PAGE, details(res, 1)
    assert c["corrupt"] >= 1 and c["load_failures"] == 0, c
    assert c["loads"] >= 2 and c["load_layers"] >= 2 * 2 and c["load_bytes"] > 0, c
