"""Reference host tier and P/D transport in plain torch + files, selected with
``kv_connector_extra_config={"host_tier": "ref_backends:FileTier"}`` /
``{"pd_transport": "ref_backends:FileTransport"}`` (this directory on PYTHONPATH).

They implement the methods of tpu_sync.vllm.backends.StoreTier / EndpointTransport so the
connector's vLLM-facing logic (which blocks, which hashes, when) can be checked on a real engine
independently of tpu_sync's native data path. Directory: $TPU_SYNC_REF_DIR.
"""

import hashlib
import json
import os
import time

import torch


def _dir(sub):
    d = os.path.join(os.environ["TPU_SYNC_REF_DIR"], sub)
    os.makedirs(d, exist_ok=True)
    return d


def _block(caches, b):
    return torch.cat([t[b].reshape(-1).view(torch.uint8) for t in caches.tensors])


def _write_block(caches, b, data):
    n = caches.layer_block_bytes
    for i, t in enumerate(caches.tensors):
        t[b].reshape(-1).view(torch.uint8).copy_(data[i * n:(i + 1) * n])


class ChecksumError(RuntimeError):
    pass


class FileTier:
    def __init__(self, cfg, geometry, caches):
        self.caches = caches
        self.dir = _dir("tier-" + hashlib.sha256(geometry.namespace(cfg.namespace).encode()).hexdigest()[:12])
        self.verify = cfg.verify_checksums
        self.puts = self.gets = 0

    def _path(self, h):
        return os.path.join(self.dir, bytes(h).hex()[:40])

    def lookup(self, hashes):
        n = 0
        for h in hashes:
            if not os.path.exists(self._path(h)):
                break
            n += 1
        return n

    def pin(self, hashes):
        class Lease:
            def close(self):
                pass

        return Lease()

    def put(self, hashes, block_ids, parent=None):
        for h, b in zip(hashes, block_ids):
            data = _block(self.caches, b).numpy().tobytes()
            with open(self._path(h), "wb") as f:
                f.write(hashlib.sha256(data).digest() + data)
            self.puts += 1
        return len(block_ids)

    def get(self, hashes, block_ids):
        for i, (h, b) in enumerate(zip(hashes, block_ids)):
            try:
                raw = open(self._path(h), "rb").read()
            except FileNotFoundError:
                return i
            data = raw[32:]
            if self.verify and hashlib.sha256(data).digest() != raw[:32]:
                raise ChecksumError(f"block {bytes(h).hex()[:16]}")
            _write_block(self.caches, b, torch.frombuffer(bytearray(data), dtype=torch.uint8))
            self.gets += 1
        return len(block_ids)

    def stats(self):
        return dict(puts=self.puts, gets=self.gets)

    def close(self):
        pass


class FailingReadsTier:
    """tpu_sync's own host tier (``StoreTier``) whose reads all fail with an I/O error, as a
    failing disk or device would: saves and lookups are real, so a second pass hits the tier
    and every load fails. For the engine tests of load failures."""

    def __init__(self, cfg, geometry, caches):
        from tpu_sync.vllm.backends import StoreTier

        self._tier = StoreTier(cfg, geometry, caches)

    def __getattr__(self, name):
        return getattr(self._tier, name)

    def _fail(self, *args, **kwargs):
        import errno

        raise OSError(errno.EIO, "injected host-tier read failure")

    get = get_groups = get_host = _fail


class _Handle:
    def __init__(self, fn):
        self.done = False
        self.error = None
        self._fn = fn

    def poll(self):
        if not self.done:
            try:
                self.done = self._fn()
            except Exception as e:
                self.error, self.done = e, True
        return self.done

    def cancel(self):
        self.done = True


class FileTransport:
    def __init__(self, cfg, geometry, caches):
        self.caches = caches
        self.dir = _dir("pd")
        self.address = f"file:{os.getpid()}"

    def register(self, xfer_id, placement, num_tokens, lease_s, pullers=1):
        ids = placement["block_ids"][self.caches.tp_rank]
        data = b"".join(_block(self.caches, b).numpy().tobytes() for b in ids)
        p = os.path.join(self.dir, str(xfer_id))
        with open(p + ".tmp", "wb") as f:
            f.write(data)
        json.dump(dict(n=len(ids)), open(p + ".json", "w"))
        os.replace(p + ".tmp", p)

    def pull(self, xfer_id, peers, src, dst, num_tokens):
        p = os.path.join(self.dir, str(xfer_id))
        ids = dst["block_ids"][self.caches.tp_rank]
        nb = self.caches.layer_block_bytes * len(self.caches.tensors)

        def step():
            if not os.path.exists(p):
                return False
            raw = bytearray(open(p, "rb").read())
            assert len(raw) == nb * len(ids), (len(raw), nb, len(ids))
            for i, b in enumerate(ids):
                _write_block(self.caches, b, torch.frombuffer(raw[i * nb:(i + 1) * nb], dtype=torch.uint8))
            return True

        h = _Handle(step)

        class Poll:
            @property
            def done(self):
                return h.poll()

            @property
            def error(self):
                return h.error

            def cancel(self):
                h.cancel()

        return Poll()

    def close(self):
        pass
