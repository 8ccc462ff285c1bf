"""Real SGLang 0.5.23 engines on CPU (tiny random Llama, greedy), each in its own process
(``run_engine.py``, started together by the ``launched`` fixture), compared token for token.

* ``direct``: HiCache with SGLang's own ``direct`` I/O backend (the reference);
* ``tpu_sync``: the same with the tpu_sync I/O backend (``TPU_SYNC_HICACHE_IO=1``) and the
  tpu_sync L3 storage backend in a ``/dev/shm`` tier; device pages are evicted by filler prompts
  so that the repeated prompts are loaded back from the host pool (L2 -> L1 through tpu_sync);
* ``restart``: a new engine process re-attaches that tier: a prompt sharing the first prompt's
  prefix hits it from L3 (``cached_tokens_details``), and a page corrupted in the tier meanwhile
  fails its checksum and is recomputed; outputs stay identical.
"""

import pytest

from engines import A, PAGE, details, toks


@pytest.fixture(scope="module")
def runs(launched):
    """The reference and the tpu_sync engine."""
    return launched.finish("direct"), launched.finish("tpu_sync")


def test_io_backend_matches_direct_and_moves_the_pages(runs):
    ref, ours = runs
    assert len({tuple(t) for t in toks(ref, 0)}) == 2, "the model must not be degenerate"
    for step in (0, 1, 2, 3):
        assert toks(ours, step) == toks(ref, step), f"step {step} differs from the direct backend"
    assert toks(ref, 2) == toks(ref, 0)
    # The repeated prompts were evicted from the device and loaded back from the host pool.
    d = details(ours, 2)
    assert all(x.get("host", 0) >= 256 for x in d), d
    io = ours["stats"]["io"]
    assert len(io) == 1, io
    c = io[0]
    assert c["backup_calls"] > 0 and c["backup_bytes"] > 0 and c["load_layers"] >= 2 and c["load_bytes"] > 0, c
    assert c["fallbacks"] == 0, c
    # The library's own pacer counters saw the copies.
    assert c["pacing"]["bytes"] >= c["backup_bytes"] + c["load_bytes"], c
    assert ref["stats"]["io"] == []  # the reference never used tpu_sync
    st = ours["stats"]["storage"][0]
    assert st["set_stored"] > 0 and st["errors"] == 0, st


def test_restarted_engine_hits_l3_and_recomputes_a_corrupted_page(restarted, runs):
    ref, ours = runs
    res = restarted.finish("restart")
    # A new process: the shared prefix of A0X came from the re-attached L3 tier.
    d = details(res, 0)[0]
    assert d.get("storage", 0) >= 256, d
    assert toks(res, 0) == toks(ref, 3)
    # The corrupted page failed its checksum: a miss from there on, recomputed, same output.
    assert toks(res, 1) == [toks(ref, 0)[1]]
    st = res["stats"]["storage"][0]
    assert st["corrupt"] >= 1 and st["errors"] == 0, st
    assert details(res, 1)[0].get("storage", 0) <= 3 * PAGE, details(res, 1)
