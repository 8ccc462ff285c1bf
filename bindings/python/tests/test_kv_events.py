"""The host tier's KV events, received by a ZMQ subscriber written from vLLM 0.32's event message
definitions (``vllm/distributed/kv_events.py``: msgspec structs, topic/sequence/payload frames,
the ROUTER replay protocol): a put's BlockStored and an eviction's BlockRemoved arrive in order
with the engine's hashes and tokens; a spill moves a block from CPU to STORAGE; replay returns
the batches the subscriber missed (the AllBlocksCleared sent at open, before it connected)."""

import os
import time
from typing import Any

import msgspec
import pytest
import zmq

import tpu_sync

BLOCK = 4096


# --- vLLM 0.32's definitions (vllm/distributed/kv_events.py) ---------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


END_SEQ = (-1).to_bytes(8, "big", signed=True)
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


class Subscriber:
    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)

    def recv(self, timeout_ms: int = 10_000):
        if not self.sub.poll(timeout_ms):
            raise AssertionError("no KV event batch arrived")
        topic, seq, payload = self.sub.recv_multipart()
        return topic, int.from_bytes(seq, "big"), decoder.decode(payload), payload

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def join(s: tpu_sync.Store, sub: Subscriber) -> int:
    """Clears the (empty) store until the subscriber sees the AllBlocksCleared: the subscription
    has reached the publisher. Returns the sequence number seen."""
    for _ in range(200):
        s.clear()
        if sub.sub.poll(50):
            _, seq, b, _ = sub.recv()
            assert [type(e) for e in b.events] == [AllBlocksCleared]
            # Drain other probes.
            while sub.sub.poll(200):
                _, seq, b, _ = sub.recv()
                assert [type(e) for e in b.events] == [AllBlocksCleared]
            return seq
    raise AssertionError("the subscription never reached the publisher")


def replay(endpoint: str, start: int):
    """vLLM's replay request from a DEALER (the frames a REQ socket sends: an empty delimiter and
    the start sequence, 8 bytes big-endian); returns [(seq, payload)] up to the end marker."""
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.connect(endpoint)
    req.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert req.poll(10_000), "replay did not answer"
            empty, topic, seq, payload = req.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        req.close(linger=0)
        ctx.term()


def events_store(**kw):
    ev = dict(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", block_size=16)
    ev.update(kw.pop("events", {}))
    args = dict(namespace="events-test", block_bytes=BLOCK, capacity_bytes=4 * BLOCK, lock_memory=False,
                populate=False, kv_events=ev)
    args.update(kw)
    return tpu_sync.Store(**args)


def test_put_and_eviction_in_order_with_engine_hashes_and_replay(data):
    with events_store() as s:
        eps = s.kv_events()
        assert eps["endpoint"].startswith("tcp://127.0.0.1:") and eps["replay_endpoint"]
        sub = Subscriber(eps["endpoint"])
        try:
            first = join(s, sub)
            tokens_a = list(range(100, 148))
            a = s.chain_keys(tokens_a, 16)
            ha = [os.urandom(32) for _ in a]
            s.describe_blocks(a, ha, [tokens_a[i * 16:(i + 1) * 16] for i in range(3)])
            assert s.put(a, [data(BLOCK, i) for i in range(3)]).stored == 3
            # A put streams in windows of half the slots: one batch per window.
            _, seq1, b1, _ = sub.recv()
            assert seq1 > first
            assert b1.data_parallel_rank == 0 and b1.ts > 0
            assert b1.events == [BlockStored(block_hashes=ha[:2], parent_block_hash=None, token_ids=tokens_a[:32],
                                             block_size=16, lora_id=None, medium="CPU", lora_name=None)]
            _, seq2, b2, _ = sub.recv()
            assert seq2 == seq1 + 1
            assert b2.events == [BlockStored(block_hashes=ha[2:], parent_block_hash=ha[1], token_ids=tokens_a[32:],
                                             block_size=16, lora_id=None, medium="CPU", lora_name=None)]
            # A second chain of 3 in a 4-block tier: the first chain's tail goes, last block first,
            # each eviction right before the store that needed its slot.
            tokens_b = list(range(900, 948))
            b = s.chain_keys(tokens_b, 16)
            hb = [os.urandom(32) for _ in b]
            s.describe_blocks(b, hb)
            assert s.put(b, [data(BLOCK, 10 + i) for i in range(3)]).stored == 3
            got = []
            while sum(len(e.block_hashes) for e in got) < 5:
                got.extend(sub.recv()[2].events)
            flat = [(type(e).__name__, e.medium, h) for e in got for h in e.block_hashes]
            assert flat == [("BlockRemoved", "CPU", ha[2]), ("BlockStored", "CPU", hb[0]),
                            ("BlockStored", "CPU", hb[1]), ("BlockRemoved", "CPU", ha[1]),
                            ("BlockStored", "CPU", hb[2])]
            stored_b = [e for e in got if isinstance(e, BlockStored)]
            assert stored_b[0].parent_block_hash is None and stored_b[-1].parent_block_hash == hb[1]
            assert all(e.token_ids == [] and e.block_size == 16 for e in stored_b)
            assert s.lookup(a) == 1 and s.lookup(b) == 3

            # Replay from 0: the AllBlocksCleared of the open (sent before the subscriber existed),
            # the probes, then the same payloads the subscriber received, in sequence order.
            r = replay(eps["replay_endpoint"], 0)
            seqs = [q for q, _ in r]
            assert seqs == list(range(len(seqs))) and seqs[-1] >= seq2 + 1
            assert [type(e) for e in decoder.decode(r[0][1]).events] == [AllBlocksCleared]
            assert decoder.decode(r[seq1][1]).events == b1.events
            assert replay(eps["replay_endpoint"], seq1)[0][0] == seq1
            assert replay(eps["replay_endpoint"], 10**9) == []
        finally:
            sub.close()


def test_spill_moves_a_block_to_storage_and_undescribed_blocks_use_key_bytes(data, tmp_path):
    with events_store(disk_dir=str(tmp_path / "d"), disk_capacity_bytes=64 * (BLOCK + 8192),
                      events=dict(disk_medium="DISK", int_hashes=False)) as s:
        sub = Subscriber(s.kv_events()["endpoint"])
        try:
            join(s, sub)
            keys = s.chain_keys(list(range(5 * 16)), 16)
            assert s.put(keys, [data(BLOCK, 50 + i) for i in range(5)]).stored == 5
            got = []
            deadline = time.monotonic() + 10
            while sum(len(e.block_hashes) for e in got if isinstance(e, BlockStored) and e.medium == "CPU") < 5:
                assert time.monotonic() < deadline
                got.extend(sub.recv()[2].events)
            # One block (the least recent) spilled: stored on DISK, its CPU copy removed; every
            # hash is the block's 16 key bytes (no description given).
            disk = [h for e in got if isinstance(e, BlockStored) and e.medium == "DISK" for h in e.block_hashes]
            gone = [h for e in got if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes]
            cpu = [h for e in got if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes]
            assert len(disk) == 1 and disk == gone and disk[0] in keys
            assert s.lookup(keys) == 5
            assert sorted(cpu) == sorted(keys)
        finally:
            sub.close()


def test_int_hashes_topic_and_bad_config(data):
    with events_store(events=dict(int_hashes=True, topic="kv@tpu-sync")) as s:
        sub = Subscriber(s.kv_events()["endpoint"], b"kv@")
        try:
            join(s, sub)
            keys = s.chain_keys(list(range(16)), 16)
            h = bytes(range(32))
            s.describe_blocks(keys, [h])
            s.put(keys, [data(BLOCK, 1)])
            topic, _, b, _ = sub.recv()
            assert topic == b"kv@tpu-sync"
            assert b.events[0].block_hashes == [int.from_bytes(h, "big") & ((1 << 64) - 1)]
        finally:
            sub.close()
    with pytest.raises(tpu_sync.errors.InvalidArgumentError):
        events_store(events=dict(endpoint="ipc:///tmp/nope"))
    with pytest.raises(tpu_sync.errors.InvalidArgumentError):
        events_store(events=dict(bogus=1))
    with tpu_sync.Store(namespace="x", block_bytes=BLOCK, capacity_bytes=4 * BLOCK, lock_memory=False) as s:
        assert s.kv_events() is None
        s.describe_blocks(s.chain_keys(list(range(16)), 16), [b"h"])  # a no-op without events
