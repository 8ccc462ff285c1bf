"""One worker's per-layer KV tensors held by torch, on the CPU or on an accelerator (issue 25).

vLLM's workers hand the connector ``register_kv_caches(dict[str, Tensor])``. On vLLM's CPU
backend those tensors are host memory, which tpu_sync's PJRT client (the XLA CPU plugin) views in
place. On vLLM-TorchTPU they are ``torch_tpu`` tensors in a TPU's HBM, and on a GPU build CUDA
tensors: their ``data_ptr()`` is a device address, which only the device's own PJRT client could
address (the native shim of issue 25, not built: it would hand their ``PJRT_Buffer*`` to
:meth:`tpu_sync.Client.adopt_buffer`). Viewing such a pointer as host memory would read and write
arbitrary bytes, so :class:`TorchKv` picks one of two back ends (:attr:`TorchKv.backend`, the
reason in :attr:`TorchKv.backend_reason` and :meth:`TorchKv.stats`):

* ``"pjrt-view"``: the tensors' own memory, viewed without a copy as PJRT buffers of tpu_sync's
  client. Only for contiguous CPU tensors.
* ``"framework-copy"``: torch's own copies, on any device. Before tpu_sync reads blocks (a P/D
  registration, a host-tier save), :meth:`TorchKv.stage` copies them from the device into host
  mirrors of the tensors (same shapes and block ids; anonymous memory in small pages, given
  back by :meth:`TorchKv.drop`, all of it whenever no block is in flight); after tpu_sync wrote
  blocks into the mirrors (a pull, a host-tier load), :meth:`TorchKv.commit` copies them into the
  device tensors, in place. With ``batch_transfer`` the device holds the gathered blocks of
  every layer during a stage or commit (the request's KV once more in HBM, as in vLLM-TorchTPU's
  own connector). Copies are whole blocks through the framework, which sees the tensors' logical layout, so
  a TPU's tiled physical layout never reaches tpu_sync. The tensors may be strided per-layer
  views of one block-major bundle (vLLM-TorchTPU's ``VLLM_TPU_BLOCK_MAJOR_KV``:
  ``kv_cache_manager.py`` binds ``bundle[:, layer]`` of a ``[num_blocks, layers, BS, R, P, D']``
  bundle); the mirrors are per layer and contiguous, so tpu_sync plans them like any per-layer
  cache. When the views are exactly the bundle's layers in order (:attr:`TorchKv.bundle`), each
  device copy moves every layer of its blocks at once (a stage: one D2H of ``bundle[ids]``, then
  host copies into the per-layer mirrors; a commit: the mirrors' blocks stacked on the host, one
  H2D, one ``index_put_``), which is what the bundle is for, also when the views are kernel pages
  seen as scheduler blocks (the bundle then ``[num_blocks, s, layers, kernel_block_size, ...]``);
  otherwise one copy per layer. The
  copy API (:attr:`TorchKv.copy_api`):

  - ``"batch_transfer"``: torch_tpu's batched copies, as vLLM-TorchTPU's own ``TPUConnector``
    makes them (``vllm_torchtpu/distributed/kv_transfer/tpu_connector.py`` 0.29.0: the blocks
    gathered on the device by ``torch.index_select``, then
    ``torch_tpu._internal.batch_transfer.batch_transfer_d2h_sync(device_tensors, host_tensors)``;
    H2D by ``batch_transfer_h2d_sync(host_tensors, device_tensors)`` into fresh device tensors,
    then ``cache.index_put_``). Chosen for tensors on a ``tpu`` device when that module imports
    (the engine has imported torch_tpu already; this module never imports it otherwise).
  - ``"torch"``: ``Tensor.copy_`` between the device tensors and the mirrors, one copy per
    contiguous run of block ids, on any device.

  Every copy and gather runs on integer views of the tensors with the same element size, so the
  bytes move as bit patterns (fp8 needs no gather kernel; no NaN payload is canonicalised).

Thread-safety: one :class:`TorchKv` per worker. The framework's copies are issued by the caller's
thread (the model thread); the ``finish`` of :meth:`TorchKv.stage_async` and :meth:`TorchKv.drop`
may run on another thread (the worker's host-tier saver). Copies must not overlap a forward that
writes the same blocks (the connector hooks run between forwards, and a block being saved is not
freed before its save is reported).
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from . import _check as ck
from .arrays import ITEMSIZE
from ._native import lib
from .errors import InvalidArgumentError, UnsupportedError

log = logging.getLogger("tpu_sync.torch")

#: Back ends (``"auto"``: ``pjrt-view`` for CPU tensors, ``framework-copy`` otherwise).
BACKENDS = ("auto", "pjrt-view", "framework-copy")
#: Copy APIs of ``framework-copy`` (``"auto"``: ``batch_transfer`` on a ``tpu`` device where
#: torch_tpu's module imports, ``torch`` otherwise).
COPY_APIS = ("auto", "torch", "batch_transfer")

#: torch dtype name -> tpu_sync buffer dtype (what :meth:`tpu_sync.Client.view` takes).
TORCH_DTYPES = {
    "torch.bfloat16": "bf16",
    "torch.float16": "f16",
    "torch.float32": "f32",
    "torch.float8_e4m3fn": "f8e4m3fn",
    "torch.uint8": "u8",
}

NULL_BLOCK_ID = ck.NULL_BLOCK_ID

#: Where torch_tpu's batched copies live (torch_tpu 0.2.0).
BATCH_TRANSFER_MODULE = "torch_tpu._internal.batch_transfer"


def _fail(cls: type, msg: str) -> Exception:
    status = {InvalidArgumentError: lib.TPU_SYNC_INVALID_ARGUMENT, UnsupportedError: lib.TPU_SYNC_UNSUPPORTED}[cls]
    return cls(status, msg)


def _runs(ids: Sequence[int]) -> List[Tuple[int, int]]:
    """``[start, end)`` runs of consecutive ids, in the order given."""
    out: List[Tuple[int, int]] = []
    for b in ids:
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out


class _Mirrored:
    """What :class:`TorchKv` and :class:`StateKv` share: host mirrors (``_maps``, ``_mirrors``)
    viewed as PJRT buffers (``_views``), written back after a pull."""

    _views: Optional[List[Any]]
    _maps: List[mmap.mmap]
    _mirrors: List[Any]

    def _init_mirrors(self, client: Any) -> None:
        """The client (a new one on the XLA CPU plugin when None), no mirrors yet, zero
        counters, nothing in flight."""
        if client is None:
            import tpu_sync

            client = tpu_sync.Client()
        self.client = client
        self._views = None
        self._maps = []
        self._mirrors = []
        #: device_copies: copies between the device and the host the framework was asked for
        #: (a run of blocks of one layer, or of every layer of a bundle, is one)
        self._counters = dict(stages=0, commits=0, d2h_bytes=0, h2d_bytes=0, device_copies=0)
        #: blocks staged or about to be written and not dropped yet (whose mirror pages hold data)
        self._inflight: Set[int] = set()
        #: guards ``_inflight``, the counters and the mirrors' pages (:meth:`stage_async`'s
        #: finish and :meth:`drop` may run on a saver thread)
        self._lock = threading.Lock()

    def commit(self, block_ids: Any) -> None:  # pragma: no cover - defined by the subclasses
        raise NotImplementedError

    def drop(self, block_ids: Any) -> None:  # pragma: no cover - defined by the subclasses
        raise NotImplementedError

    def _hold(self, ids: Sequence[int]) -> None:
        with self._lock:
            self._inflight.update(ids)

    def after_write(self, block_ids: Any, ptrs: Tuple[int, ...] = ()) -> None:
        """After tpu_sync wrote blocks ``block_ids`` (a pull; as :meth:`before_write`): commits
        them into the device tensors (``framework-copy``) and gives the mirrors' pages back
        (``before_write``'s holds; the worker also drops a failed or cancelled pull's blocks)."""
        try:
            self.commit(block_ids)
        finally:
            self.drop(block_ids)

    def close(self) -> None:
        """Closes the views and frees the mirrors (the tensors are untouched)."""
        if self._views is not None:
            for v in self._views:
                v.close()
            self._views = None
        self._mirrors = []
        self._maps = []


class TorchKv(_Mirrored):
    """A worker's per-layer KV tensors (``[num_blocks, ...]`` each, all of one shape, dtype and
    device, blocks apart by at least a block: whole tensors, strided per-layer views of a
    block-major bundle, or logical views whose blocks are not contiguous, such as kernel pages
    seen as scheduler blocks), moved by tpu_sync in place (contiguous CPU tensors) or through
    torch's copies (any of them: the host mirrors hold each block's elements in the tensors'
    logical order, contiguous).

    Args:
        tensors: the per-layer tensors, in layer order.
        backend: ``"auto"``, ``"pjrt-view"`` or ``"framework-copy"`` (module docs).
        copy_api: ``"auto"``, ``"torch"`` or ``"batch_transfer"`` (``framework-copy`` only).
        client: the tpu_sync client that views the tensors or the mirrors (default: a new one on
            the XLA CPU plugin).
        block_size: tokens per block, for :meth:`before_write` (None: a pull's last block is
            always staged first, as if partial).
        view_shape: the shape tpu_sync sees the buffers (tensors or mirrors) in, of the same
            bytes (e.g. ``[num_blocks, H, block_size, 2 * D']`` for a cache moved as opaque
            ``(block, head)`` regions); None: the tensors' own shape.
        layer_group: the KV cache group of each layer (vLLM's hybrid allocator: e.g. sliding
            window and full attention, each group with its own block table over one shared
            block pool), ``0..G-1``; None: one group. With several groups the copy methods take
            one list of block ids per group (:meth:`stage`), and each layer's tensor is copied
            at its own group's blocks only: layers of different groups may share one tensor
            (vLLM binds the layers at one position of every group to the same memory), so a
            block of another group is never written through a layer's tensor.
        view_dtype: the tpu_sync dtype the buffers are viewed as, with ``view_shape`` in its
            elements (the same bytes; e.g. ``"f8e4m3fn"`` for vLLM-TorchTPU's sparse MLA caches,
            fp8 bytes held in ``uint32`` or ``uint8`` tensors); None: the tensors' own dtype,
            which must then be one tpu_sync describes.

    Raises:
        InvalidArgumentError: no tensors, tensors that differ in shape, dtype or device, blocks
            closer than a block apart, ``pjrt-view`` of strided views (non-contiguous tensors,
            blocks included), a dtype tpu_sync cannot describe, an unknown back end or copy API;
        UnsupportedError: ``pjrt-view`` of accelerator tensors; ``batch_transfer`` where torch_tpu's
            module does not import.
    """

    def __init__(self, tensors: Sequence[Any], *, backend: str = "auto", copy_api: str = "auto",
                 client: Any = None, block_size: Optional[int] = None,
                 view_shape: Optional[Sequence[int]] = None,
                 layer_group: Optional[Sequence[int]] = None, view_dtype: Optional[str] = None) -> None:
        if backend not in BACKENDS:
            raise _fail(InvalidArgumentError, f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if copy_api not in COPY_APIS:
            raise _fail(InvalidArgumentError, f"copy_api {copy_api!r} is not one of {', '.join(COPY_APIS)}")
        tensors = list(tensors)
        if not tensors:
            raise _fail(InvalidArgumentError, "no KV tensors")
        t0 = tensors[0]
        for i, t in enumerate(tensors):
            if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device:
                raise _fail(InvalidArgumentError, f"layer {i}: {list(t.shape)} {t.dtype} on {t.device} differs from "
                            f"layer 0's {list(t0.shape)} {t0.dtype} on {t0.device}")
        if t0.dim() < 2:
            raise _fail(InvalidArgumentError, f"a KV tensor of shape {list(t0.shape)}: expected [num_blocks, ...]")
        for i, t in enumerate(tensors):
            if not (t.shape[0] <= 1 or int(t.stride(0)) >= int(t[0].numel())):
                raise _fail(InvalidArgumentError, f"layer {i}'s KV tensor has strides {list(t.stride())}: blocks must "
                            "be apart by at least a block")
        dt = str(t0.dtype)
        if view_dtype is None and dt not in TORCH_DTYPES:
            raise _fail(InvalidArgumentError, f"KV tensor dtype {dt} (supported: {', '.join(TORCH_DTYPES)})")
        if view_dtype is not None and view_dtype not in ITEMSIZE:
            raise _fail(InvalidArgumentError, f"view dtype {view_dtype!r} (supported: {', '.join(ITEMSIZE)})")
        if int(t0.element_size()) not in (1, 2, 4):
            raise _fail(InvalidArgumentError, f"KV tensor dtype {dt} of {t0.element_size()} bytes per element")
        if layer_group is not None:
            layer_group = [int(g) for g in layer_group]
            if len(layer_group) != len(tensors) or sorted(set(layer_group)) != list(range(max(layer_group) + 1)):
                raise _fail(InvalidArgumentError, f"layer groups {layer_group} for {len(tensors)} layers: expected one "
                            "group index per layer, the groups numbered 0..G-1 without a gap")
        #: KV cache group of each layer (None: one group); groups ``0..num_groups-1``
        self.layer_group = layer_group
        self.num_groups = 1 if layer_group is None else max(layer_group) + 1
        self.tensors = tensors
        self.shape = tuple(int(d) for d in t0.shape)
        self.view_shape = None if view_shape is None else tuple(int(d) for d in view_shape)
        self.dtype = t0.dtype
        self.buffer_dtype = view_dtype or TORCH_DTYPES[dt]
        esize = int(t0.element_size())
        vsize = ITEMSIZE[self.buffer_dtype]
        if self.view_shape is not None and (math.prod(self.view_shape) * vsize != math.prod(self.shape) * esize or
                                            not self.view_shape or self.view_shape[0] != self.shape[0]):
            raise _fail(InvalidArgumentError, f"view shape {list(self.view_shape)} ({self.buffer_dtype}) is not the "
                        f"{self.shape[0]} blocks and {math.prod(self.shape) * esize} bytes of {list(self.shape)} {dt}")
        if self.view_shape is None and vsize != esize:
            raise _fail(InvalidArgumentError, f"view dtype {self.buffer_dtype} of {dt} tensors needs a view shape")
        self.device = t0.device
        #: copies and gathers run on integer views of the same element size (bit patterns: no
        #: dtype support needed for fp8, no NaN canonicalisation)
        self._bits = {1: "uint8", 2: "int16", 4: "int32"}[int(t0.element_size())]
        self.num_blocks = self.shape[0]
        self.block_size = block_size
        #: bytes of one block of one layer (the mirrors' block stride)
        self.block_bytes = int(t0[0].numel()) * int(t0.element_size())
        self.nbytes = self.num_blocks * self.block_bytes
        host = self.device.type == "cpu"
        #: per-layer strided views of one block-major bundle (vLLM-TorchTPU's
        #: ``VLLM_TPU_BLOCK_MAJOR_KV``: ``bundle[:, layer]`` of ``[N, F, BS, R, P, D']``), padded
        #: rows (blocks further apart than a block), or logical views whose blocks are not
        #: contiguous (kernel pages seen as scheduler blocks: only framework copies move them)
        self.strided = not all(t.is_contiguous() for t in tensors)
        #: ``[num_blocks, layers, ...]`` (or ``[num_blocks, s, layers, ...]`` for kernel pages):
        #: the block-major bundle whose layers ``tensors`` are, in order, on axis
        #: :attr:`bundle_axis` (:func:`_bundle_of`), which framework copies move whole; None
        #: otherwise
        self.bundle: Any = None
        self.bundle_axis = 1
        found = _bundle_of(tensors) if self.strided and self.num_groups == 1 else None
        if found is not None:
            self.bundle, self.bundle_axis = found
        if backend == "auto":
            if host and not self.strided:
                backend, why = "pjrt-view", "the tensors are in host memory: viewed in place"
            elif host:
                backend = "framework-copy"
                why = (f"the per-layer tensors are strided views (block stride {int(t0.stride(0))} elements, e.g. "
                       "of a block-major bundle), which a PJRT buffer cannot view: torch's own copies")
            else:
                backend = "framework-copy"
                why = (f"the tensors are on {self.device.type} devices, whose memory tpu_sync's client cannot "
                       "address: torch's own copies")
        else:
            why = "chosen by the caller"
        if backend == "pjrt-view" and not host:
            raise _fail(UnsupportedError, f"backend pjrt-view needs the KV tensors in host memory; they are on "
                        f"{self.device} (use framework-copy)")
        if backend == "pjrt-view" and self.strided:
            raise _fail(InvalidArgumentError, f"backend pjrt-view needs contiguous KV tensors; these have strides "
                        f"{list(t0.stride())} (use framework-copy)")
        self.backend, self.backend_reason = backend, why
        self._bt: Any = None
        if backend == "framework-copy":
            copy_api, self._bt = _copy_api_for(copy_api, self.device)
        else:
            copy_api = "none"
        self.copy_api = copy_api
        self._init_mirrors(client)
        log.info("tpu_sync.torch: %d layers of %s %s on %s; back end %s (%s), copies %s%s", len(tensors),
                 list(self.shape), dt, self.device, backend, why, copy_api,
                 ", bundle-wide" if self.bundle is not None and backend == "framework-copy" else "")

    # -- what tpu_sync reads and writes ---------------------------------------------------------

    def views(self) -> List[Any]:
        """Per-layer PJRT buffers tpu_sync copies blocks in and out of, in the tensors' block
        geometry (same block ids): the tensors themselves (``pjrt-view``), or their host mirrors
        (``framework-copy``: :meth:`stage` before tpu_sync reads, :meth:`commit` after it
        wrote)."""
        if self._views is None:
            if self.backend == "pjrt-view":
                self._views = [self.client.view(t, shape=self.view_shape, dtype=self.buffer_dtype)
                               for t in self.tensors]
            else:
                import numpy as np
                import torch

                views = []
                for _ in self.tensors:
                    m = _mirror(self.nbytes)
                    self._maps.append(m)
                    raw = torch.frombuffer(m, dtype=torch.uint8, count=self.nbytes)
                    self._mirrors.append(raw.view(getattr(torch, self._bits)).view(self.shape))
                    views.append(self.client.view(np.frombuffer(m, dtype=np.uint8, count=self.nbytes),
                                                  shape=self.view_shape or self.shape, dtype=self.buffer_dtype))
                self._views = views
        return self._views

    def stats(self) -> Dict[str, Any]:
        """Back end, reason, copy API, geometry, and counters (stages and commits, bytes copied by
        torch between the device and the mirrors)."""
        return dict(self._counters, backend=self.backend, backend_reason=self.backend_reason,
                    copy_api=self.copy_api, device=str(self.device), shape=list(self.shape), dtype=str(self.dtype),
                    bundle_wide=self.bundle is not None)

    def _ids(self, block_ids: Sequence[int]) -> List[int]:
        ids = [ck.u32("block id", b) for b in block_ids]
        for b in ids:
            if b >= self.num_blocks:
                raise IndexError(f"block id {b} out of range 0..{self.num_blocks}")
        return ids

    def _parts(self, block_ids: Any) -> List[Tuple[List[int], List[int]]]:
        """``block_ids`` as ``(layers, ids)`` pairs: a flat list is every layer's; one list per
        KV cache group (``[[...], ...]``, as many as :attr:`num_groups`) is the blocks of that
        group's layers, vLLM's null block (id 0) skipped. Pairs without ids are left out.

        Raises:
            InvalidArgumentError: per-group lists for another number of groups;
            IndexError: a block id out of range."""
        ids = list(block_ids)
        if ck.per_group(ids):
            if len(ids) != self.num_groups:
                raise _fail(InvalidArgumentError, f"block ids for {len(ids)} KV cache groups; the layers are in "
                            f"{self.num_groups}")
            groups = self.layer_group or [0] * len(self.tensors)
            out = []
            for g, gids in enumerate(ids):
                checked = self._ids([b for b in gids if int(b) != NULL_BLOCK_ID])
                layers = [i for i, lg in enumerate(groups) if lg == g]
                if checked and layers:
                    out.append((layers, checked))
            return out
        if self.num_groups > 1 and ids:
            # One list for layers of several groups would copy every layer at every group's
            # blocks: through a tensor the groups share, a group's blocks overwritten.
            raise _fail(InvalidArgumentError, f"a flat list of block ids for layers in {self.num_groups} KV cache "
                        "groups: give one list per group")
        checked = self._ids(ids)
        return [(list(range(len(self.tensors))), checked)] if checked else []

    @staticmethod
    def _flat(block_ids: Any) -> List[int]:
        """Every block id of a flat list or of per-group lists (null blocks of groups skipped)."""
        return ck.flat_block_ids(block_ids)

    # -- framework-copy -------------------------------------------------------------------------

    def _count(self, ops: str, nbytes: str, layer_blocks: int, copies: int) -> None:
        with self._lock:
            self._counters[ops] += 1
            self._counters[nbytes] += layer_blocks * self.block_bytes
            self._counters["device_copies"] += copies

    def _work(self, block_ids: Any) -> Optional[Tuple[Any, Any, List[Tuple[List[int], List[int]]]]]:
        """What a stage or commit of ``block_ids`` needs: torch, the integer dtype and the
        ``(layers, ids)`` pairs (:meth:`_parts`; mirrors made); None when there is nothing to
        copy (``pjrt-view``, no ids)."""
        if self.backend == "pjrt-view" or not len(block_ids):
            return None
        parts = self._parts(block_ids)
        if not parts:
            return None
        self.views()
        import torch

        return torch, getattr(torch, self._bits), parts

    def stage(self, block_ids: Any) -> None:
        """``framework-copy``: copies blocks ``block_ids`` of every layer from the device tensors
        into the host mirrors, before tpu_sync reads them. Nothing for ``pjrt-view``.

        Args:
            block_ids: block ids, the same for every layer; with several KV cache groups
                (``layer_group``) also one list per group, each group's layers copied at its
                own ids (vLLM's null block, id 0, skipped).

        Raises:
            IndexError: a block id out of range; InvalidArgumentError: per-group lists for
                another number of groups; torch's errors from the copies."""
        self.stage_async(block_ids)()

    def stage_async(self, block_ids: Any) -> Callable[[], None]:
        """:meth:`stage` in two halves: issues the copies now, on the calling thread (the model
        thread: the framework's ops are issued where the engine issues its own), and returns
        ``finish()``, which waits for them and completes the mirrors; call it once, on any
        thread, before tpu_sync reads the blocks. With ``batch_transfer`` the D2H runs in the
        background between the two (torch_tpu's ``batch_transfer_d2h`` and its future, as
        vLLM-TorchTPU's own connector stages: issue on the worker thread, wait on another);
        with ``torch`` the copies are done before this returns.

        Raises:
            IndexError: a block id out of range; InvalidArgumentError: per-group lists for
                another number of groups; torch's errors from the copies (here, or from
                ``finish()``)."""
        work = self._work(block_ids)
        if work is None:
            return _nothing
        torch, bits, parts = work
        for _, ids in parts:
            self._hold(ids)
        if self.bundle is not None:
            return self._stage_bundle(torch, bits, parts[0][1])
        layer_blocks = sum(len(ids) * len(layers) for layers, ids in parts)
        if self._bt is None:
            copies = 0
            for layers, ids in parts:
                runs = _runs(ids)
                _copy_runs([self._mirrors[i] for i in layers], [self.tensors[i].view(bits) for i in layers], runs)
                copies += len(runs) * len(layers)
            self._count("stages", "d2h_bytes", layer_blocks, copies)
            return _nothing
        return self._stage_batched(torch, bits, parts, layer_blocks)

    def _stage_bundle(self, torch: Any, bits: Any, ids: List[int]) -> Callable[[], None]:
        """A stage of every layer of a block-major bundle: one D2H of ``bundle[ids]`` (one per
        run of consecutive ids with ``Tensor.copy_``), then host copies into the mirrors."""
        bt = self._bt
        mirrors = self._mirrors
        bundle = self.bundle.view(bits)
        if bt is None:
            runs = _runs(ids)
            for a, b in runs:
                host = bundle[a:b].to("cpu")  # one D2H of every layer (no copy on the CPU)
                for layer, m in enumerate(mirrors):
                    m[a:b].copy_(host.select(self.bundle_axis, layer))
            self._count("stages", "d2h_bytes", len(ids) * len(mirrors), len(runs))
            return _nothing
        idx = torch.tensor(ids, dtype=torch.int64, device=self.device)
        src = [torch.index_select(bundle, 0, idx)]
        dst = [torch.empty(src[0].shape, dtype=bits, device="cpu")]
        asynchronous = hasattr(bt, "batch_transfer_d2h")
        fut = bt.batch_transfer_d2h(src, dst) if asynchronous else bt.batch_transfer_d2h_sync(src, dst)

        def finish_bundle() -> None:
            if asynchronous:
                fut.wait()  # keeps src and dst alive until the DMA is done
            hidx = torch.tensor(ids, dtype=torch.int64)
            for layer, m in enumerate(mirrors):
                m.index_copy_(0, hidx, dst[0].select(self.bundle_axis, layer))
            self._count("stages", "d2h_bytes", len(ids) * len(mirrors), 1)

        return finish_bundle

    def _stage_batched(self, torch: Any, bits: Any, parts: List[Tuple[List[int], List[int]]],
                       layer_blocks: int) -> Callable[[], None]:
        """torch_tpu's batched D2H of every ``(layers, ids)`` pair in one call (each layer's
        blocks gathered on the device at its own ids, KV cache groups included); the mirrors
        are completed by the returned ``finish``."""
        bt = self._bt
        src, dst, fills = [], [], []
        for layers, ids in parts:
            runs = _runs(ids)
            idx = torch.tensor(ids, dtype=torch.int64, device=self.device)
            single = len(runs) == 1
            for i in layers:
                src.append(torch.index_select(self.tensors[i].view(bits), 0, idx))
                if single:
                    dst.append(self._mirrors[i][runs[0][0]:runs[0][1]])  # straight into the mirror
                else:
                    dst.append(torch.empty(src[-1].shape, dtype=bits, device="cpu"))
                    fills.append((self._mirrors[i], ids, dst[-1]))
        asynchronous = hasattr(bt, "batch_transfer_d2h")
        fut = bt.batch_transfer_d2h(src, dst) if asynchronous else bt.batch_transfer_d2h_sync(src, dst)

        def finish() -> None:
            if asynchronous:
                fut.wait()  # keeps src and dst alive until the DMA is done
            for m, ids, d in fills:
                m.index_copy_(0, torch.tensor(ids, dtype=torch.int64), d)
            self._count("stages", "d2h_bytes", layer_blocks, len(src))

        return finish

    def commit(self, block_ids: Any) -> None:
        """``framework-copy``: copies blocks ``block_ids`` of every layer from the host mirrors
        into the device tensors (in place), after tpu_sync wrote them. Nothing for ``pjrt-view``.

        Args:
            block_ids: as :meth:`stage` (with several KV cache groups, one list per group: a
                layer's tensor is written at its own group's blocks only).

        Raises:
            IndexError: a block id out of range; InvalidArgumentError: per-group lists for
                another number of groups; torch's errors from the copies."""
        work = self._work(block_ids)
        if work is None:
            return
        torch, bits, parts = work
        if self.bundle is not None:
            ids = parts[0][1]
            bundle = self.bundle.view(bits)
            if self._bt is not None:
                hidx = torch.tensor(ids, dtype=torch.int64)
                # The blocks of every layer side by side on the host: one H2D, one index_put_.
                src = [torch.stack([torch.index_select(m, 0, hidx) for m in self._mirrors], dim=self.bundle_axis)]
                dev = [torch.empty(src[0].shape, dtype=bits, device=self.device)]
                self._bt.batch_transfer_h2d_sync(src, dev)
                bundle.index_put_((torch.tensor(ids, dtype=torch.int64, device=self.device),), dev[0])
                self._count("commits", "h2d_bytes", len(ids) * len(self._mirrors), 1)
            else:
                runs = _runs(ids)
                for a, b in runs:
                    bundle[a:b].copy_(torch.stack([m[a:b] for m in self._mirrors], dim=self.bundle_axis))
                self._count("commits", "h2d_bytes", len(ids) * len(self._mirrors), len(runs))
            return
        layer_blocks = sum(len(ids) * len(layers) for layers, ids in parts)
        if self._bt is None:
            copies = 0
            for layers, ids in parts:
                runs = _runs(ids)
                _copy_runs([self.tensors[i].view(bits) for i in layers], [self._mirrors[i] for i in layers], runs)
                copies += len(runs) * len(layers)
            self._count("commits", "h2d_bytes", layer_blocks, copies)
            return
        # torch_tpu's batched H2D of every layer's blocks (every group's) in one call, then
        # each layer's index_put_ at its own ids.
        src, puts = [], []
        for layers, ids in parts:
            runs = _runs(ids)
            hidx = None if len(runs) == 1 else torch.tensor(ids, dtype=torch.int64)
            idx = torch.tensor(ids, dtype=torch.int64, device=self.device)
            for i in layers:
                m = self._mirrors[i]
                src.append(m[runs[0][0]:runs[0][1]] if hidx is None else torch.index_select(m, 0, hidx))
                puts.append((self.tensors[i].view(bits), idx))
        dev = [torch.empty(x.shape, dtype=bits, device=self.device) for x in src]
        self._bt.batch_transfer_h2d_sync(src, dev)
        for (t, idx), d in zip(puts, dev):
            t.index_put_((idx,), d)
        self._count("commits", "h2d_bytes", layer_blocks, len(src))

    def hold(self, block_ids: Any) -> None:
        """Marks blocks ``block_ids`` (flat or per KV cache group) in flight before tpu_sync writes
        them into the mirrors by other means than a pull (a host-tier load): until :meth:`drop`
        releases them, no :meth:`drop` of other blocks (e.g. the host-tier saver's, on its
        thread) gives their pages back, which would turn the written bytes into zeros before
        :meth:`commit`. Nothing for ``pjrt-view``."""
        if self.backend == "pjrt-view" or not len(block_ids):
            return
        self.views()
        self._hold(self._flat(block_ids))

    def drop(self, block_ids: Any) -> None:
        """``framework-copy``: gives the host memory of blocks ``block_ids``' mirror pages back
        (``madvise(MADV_DONTNEED)``: they read as zero again). Pages a block shares with a block
        still in flight (staged or being written, not dropped yet) stay; once no block is in
        flight, every page of the mirrors is given back, so between transfers the mirrors hold
        no memory. ``block_ids``: a flat list or one list per KV cache group (as :meth:`stage`).
        Nothing for ``pjrt-view``."""
        if self.backend == "pjrt-view" or not self._maps or not len(block_ids):
            return
        with self._lock:
            _give_back(self._maps, self._flat(block_ids), self._inflight, self.block_bytes, self.num_blocks)

    def before_write(self, block_ids: Any, num_tokens: int, partial: Any = None) -> Tuple[int, ...]:
        """Before tpu_sync writes ``num_tokens`` tokens into blocks ``block_ids`` (a pull; a flat
        list or one list per KV cache group, as :meth:`stage`): ``framework-copy`` writes whole
        blocks back, so the blocks the write covers only in part go into the mirror first and
        their other token slots come back unchanged. ``partial``: those blocks (as
        ``block_ids``; e.g. a sliding-window group's first block, whose tokens before the
        window are not pulled); None: the last block (of each group) when ``num_tokens`` is not
        a multiple of the block size. Returns what :meth:`after_write` takes (nothing: the
        tensors do not move)."""
        if self.backend == "pjrt-view" or not len(block_ids):
            return ()
        parts = self._parts(block_ids)
        if partial is not None:
            if self._flat(partial):
                self.stage(partial)
            for _, ids in parts:
                self._hold(ids)
            return ()
        partial = self.block_size is None or num_tokens % self.block_size != 0
        if partial and parts:
            self.stage(ck.last_block_ids(block_ids))
        for _, ids in parts:
            self._hold(ids)  # written by tpu_sync until after_write drops them
        return ()

class PartsKv:
    """One worker's KV tensors whose layers differ in block geometry: one :class:`TorchKv` (or
    :class:`StateKv`) per set of uniform layers (a *part*), behind :class:`TorchKv`'s
    interface. vLLM-TorchTPU's sparse MLA caches are one use (:attr:`tpu_sync.vllm.compat.
    KvGeometry.mla_parts`: the ``nope``, ``rope`` and indexer caches of one block table, of 512,
    128 and 256 bytes a token; every copy method then takes the same block ids for every part);
    a hybrid model's attention and Mamba state layers moved by torch's copies another (KV cache
    groups: one list of block ids per group, each part given its own groups' lists).

    Args:
        parts: the :class:`TorchKv` of each part (one back end and copy API for all; give them
            one ``client``).
        layers: the cache layers of each part, in the order of its tensors; together
            ``0..n-1`` exactly once.
        groups: with KV cache groups, the groups of each part: part ``p``'s group ``k`` (its
            ``layer_group`` index, 0 for a :class:`StateKv`) is the model's group
            ``groups[p][k]``; block ids given per group are handed to each part as the lists of
            its groups. None: every part takes the block ids as given.

    Raises:
        InvalidArgumentError: no parts, layers that are not ``0..n-1`` once each, parts of
            different back ends, a part's groups that do not match its group count.

    Thread-safety: as :class:`TorchKv`.
    """

    def __init__(self, parts: Sequence[Any], layers: Sequence[Sequence[int]],
                 groups: Optional[Sequence[Sequence[int]]] = None) -> None:
        self.parts = list(parts)
        if not self.parts or len(layers) != len(self.parts):
            raise _fail(InvalidArgumentError, f"{len(self.parts)} parts for {len(layers)} lists of layers")
        if groups is not None and (len(groups) != len(self.parts) or
                                   any(len(gs) != p.num_groups for p, gs in zip(self.parts, groups))):
            raise _fail(InvalidArgumentError, f"part groups {[list(g) for g in groups]} for parts of "
                        f"{[p.num_groups for p in self.parts]} groups")
        #: the model's groups of each part (None: block ids passed through)
        self.groups = None if groups is None else [[int(g) for g in gs] for gs in groups]
        flat = sorted(int(x) for ls in layers for x in ls)
        if flat != list(range(len(flat))) or any(len(ls) != len(p.tensors) for p, ls in zip(self.parts, layers)):
            raise _fail(InvalidArgumentError, f"part layers {[list(ls) for ls in layers]}: each part's tensors, "
                        "together every cache layer once")
        if len({(p.backend, p.copy_api) for p in self.parts}) != 1:
            raise _fail(InvalidArgumentError, "the parts' back ends or copy APIs differ")
        #: (part, index in it) of every cache layer
        self._where: List[Tuple[int, int]] = [(0, 0)] * len(flat)
        for i, ls in enumerate(layers):
            for j, layer in enumerate(ls):
                self._where[int(layer)] = (i, j)
        p0 = self.parts[0]
        self.client, self.backend, self.backend_reason = p0.client, p0.backend, p0.backend_reason
        self.copy_api, self.device, self.num_blocks = p0.copy_api, p0.device, p0.num_blocks
        #: bytes of one block of each cache layer
        self.layer_bytes = [self.parts[i].block_bytes for i, _ in self._where]

    def _ids(self, p: int, block_ids: Any) -> Any:
        """Part ``p``'s block ids: the lists of its groups where ``block_ids`` holds one per KV
        cache group (and this object knows the parts' groups), else ``block_ids``."""
        if self.groups is None or not len(block_ids) or not ck.per_group(list(block_ids)):
            return block_ids
        ids = list(block_ids)
        if len(ids) <= max(max(gs) for gs in self.groups):
            raise _fail(InvalidArgumentError, f"block ids for {len(ids)} KV cache groups; the parts are in "
                        f"{max(max(gs) for gs in self.groups) + 1}")
        return [ids[g] for g in self.groups[p]]
    def views(self) -> List[Any]:
        """Every cache layer's buffer, in cache layer order (:meth:`TorchKv.views`)."""
        per = [p.views() for p in self.parts]
        return [per[i][j] for i, j in self._where]

    def stats(self) -> Dict[str, Any]:
        """:meth:`TorchKv.stats` of the first part with the counters summed over the parts and
        each part's shape and dtype."""
        out = dict(self.parts[0].stats())
        for k in self.parts[0]._counters:
            out[k] = sum(int(p._counters[k]) for p in self.parts)
        out["shape"] = [list(p.shape) for p in self.parts]
        out["dtype"] = [str(p.dtype) for p in self.parts]
        return out

    def stage(self, block_ids: Any) -> None:
        """:meth:`TorchKv.stage` of every part."""
        self.stage_async(block_ids)()

    def stage_async(self, block_ids: Any) -> Callable[[], None]:
        """:meth:`TorchKv.stage_async` of every part; ``finish()`` finishes them all (each
        issued part's, also when one fails, so that none is left holding blocks)."""
        finishes: List[Callable[[], None]] = []
        try:
            for i, p in enumerate(self.parts):
                finishes.append(p.stage_async(self._ids(i, block_ids)))
        except BaseException:
            for f in finishes:
                try:
                    f()
                except Exception:  # the first error is the one raised
                    pass
            raise

        def finish() -> None:
            err: Optional[BaseException] = None
            for f in finishes:
                try:
                    f()
                except BaseException as e:
                    err = err or e
            if err is not None:
                raise err

        return finish

    def commit(self, block_ids: Any) -> None:
        """:meth:`TorchKv.commit` of every part."""
        for i, p in enumerate(self.parts):
            p.commit(self._ids(i, block_ids))

    def hold(self, block_ids: Any) -> None:
        """:meth:`TorchKv.hold` of every part, or of none (a part that fails releases the
        holds of those before it)."""
        done: List[int] = []
        try:
            for i, p in enumerate(self.parts):
                p.hold(self._ids(i, block_ids))
                done.append(i)
        except BaseException:
            for i in done:
                self.parts[i].drop(self._ids(i, block_ids))
            raise

    def drop(self, block_ids: Any) -> None:
        """:meth:`TorchKv.drop` of every part."""
        for i, p in enumerate(self.parts):
            p.drop(self._ids(i, block_ids))

    def before_write(self, block_ids: Any, num_tokens: int, partial: Any = None) -> Tuple[int, ...]:
        """:meth:`TorchKv.before_write` of every part."""
        for i, p in enumerate(self.parts):
            p.before_write(self._ids(i, block_ids), num_tokens, None if partial is None else self._ids(i, partial))
        return ()

    def after_write(self, block_ids: Any, ptrs: Tuple[int, ...] = ()) -> None:
        """:meth:`TorchKv.after_write` of every part (each part's, also when one fails)."""
        err: Optional[BaseException] = None
        for i, p in enumerate(self.parts):
            try:
                p.after_write(self._ids(i, block_ids))
            except BaseException as e:
                err = err or e
        if err is not None:
            raise err

    def close(self) -> None:
        """:meth:`TorchKv.close` of every part."""
        for p in self.parts:
            p.close()


class StateKv(_Mirrored):
    """One worker's Mamba / linear-attention state layers (a KV cache group of state slots)
    moved through torch's copies (``framework-copy``), behind :class:`TorchKv`'s interface.

    Each layer's state is one or more tensors ``[num_blocks, ...]`` indexed by vLLM's block
    table of the state group: vLLM's CPU engine registers one raw tensor per layer (``[blocks,
    1, 1, dense state bytes]`` inside a padded page); vLLM-TorchTPU's per-layer caches register
    a tuple of separate tensors, one per state shape (``torch.zeros((num_blocks, *shape),
    dtype)``, ``vllm_torchtpu/runner/kv_cache_manager.py`` 0.29.0 ``initialize_kv_cache``, with a
    KV connector always over ``num_blocks``). tpu_sync sees each layer as one buffer of
    ``[num_blocks, slot_bytes / item]`` (its state group's slot stride, ``MambaSpec.
    page_size_padded``): the host mirror holds each block's tensors' bytes one after another
    from the slot's start, the order of the state group's components (and of vLLM's page), so
    a slot moved from an engine with separate tensors lands in one with a shared page as it
    would between two of the same kind.

    Args:
        layers: per state layer, its tensors in component order; every layer the same shapes,
            dtypes and device; each tensor's blocks contiguous.
        slot_bytes: the mirror's block stride (>= the tensors' bytes per block).
        view_dtype: the tpu_sync dtype of the buffers (one that divides ``slot_bytes``).
        copy_api: as :class:`TorchKv` (``"auto"``: torch_tpu's ``batch_transfer`` on a ``tpu``
            device where it imports).
        client: the tpu_sync client that views the mirrors (default: a new one).

    Raises:
        InvalidArgumentError: no layers, layers that differ, blocks that are not contiguous,
            more bytes per block than ``slot_bytes``, a view dtype that does not divide it;
        UnsupportedError: ``batch_transfer`` where torch_tpu's module does not import.

    Thread-safety: as :class:`TorchKv`.
    """

    def __init__(self, layers: Sequence[Sequence[Any]], slot_bytes: int, *, view_dtype: str = "u8",
                 copy_api: str = "auto", client: Any = None) -> None:
        if copy_api not in COPY_APIS:
            raise _fail(InvalidArgumentError, f"copy_api {copy_api!r} is not one of {', '.join(COPY_APIS)}")
        self.tensors = [list(ts) for ts in layers]
        if not self.tensors or not self.tensors[0]:
            raise _fail(InvalidArgumentError, "no state layers")
        first = self.tensors[0]
        for i, ts in enumerate(self.tensors):
            if [(t.shape, t.dtype, t.device) for t in ts] != [(t.shape, t.dtype, t.device) for t in first]:
                raise _fail(InvalidArgumentError, f"state layer {i}: {[(list(t.shape), str(t.dtype)) for t in ts]} "
                            f"differs from layer 0's {[(list(t.shape), str(t.dtype)) for t in first]}")
            for t in ts:
                if t.dim() < 2 or not rows_contiguous(t) or int(t.shape[0]) != int(first[0].shape[0]):
                    raise _fail(InvalidArgumentError, f"state layer {i}: a tensor {list(t.shape)} with strides "
                                f"{list(t.stride())}: expected [num_blocks, ...] with contiguous blocks, as many "
                                "as the layer's other tensors")
        #: bytes of each tensor's block, and where it starts in a slot of the mirror
        self.part_bytes = [int(t[0].numel()) * int(t.element_size()) for t in first]
        self.block_bytes = int(slot_bytes)
        self.offsets = ck.state_slot(self.part_bytes, self.block_bytes, view_dtype, "state tensors")
        self.buffer_dtype = view_dtype
        self.num_blocks = int(first[0].shape[0])
        self.nbytes = self.num_blocks * self.block_bytes
        self.shape = (self.num_blocks, self.block_bytes // ITEMSIZE[view_dtype])
        self.dtype = [str(t.dtype) for t in first]
        self.device = first[0].device
        self.num_groups = 1
        self.backend = "framework-copy"
        self.backend_reason = "state layers: their tensors' blocks laid one after another in host mirrors"
        self.copy_api, self._bt = _copy_api_for(copy_api, self.device)
        self._init_mirrors(client)

    def views(self) -> List[Any]:
        """Per state layer, the PJRT buffer ``[num_blocks, slot_bytes / item]`` over its host
        mirror (zero until staged or written)."""
        if self._views is None:
            import numpy as np
            import torch

            views = []
            for _ in self.tensors:
                m = _mirror(self.nbytes)
                self._maps.append(m)
                self._mirrors.append(torch.frombuffer(m, dtype=torch.uint8, count=self.nbytes)
                                     .view(self.num_blocks, self.block_bytes))
                views.append(self.client.view(np.frombuffer(m, dtype=np.uint8, count=self.nbytes), shape=self.shape,
                                              dtype=self.buffer_dtype))
            self._views = views
        return self._views

    def stats(self) -> Dict[str, Any]:
        """As :meth:`TorchKv.stats`."""
        return dict(self._counters, backend=self.backend, backend_reason=self.backend_reason,
                    copy_api=self.copy_api, device=str(self.device), shape=list(self.shape), dtype=self.dtype,
                    bundle_wide=False)

    def _ids(self, block_ids: Any) -> List[int]:
        """The slot ids of ``block_ids``: a flat list, or one list per KV cache group of which
        this part has one (vLLM's null block skipped).

        Raises:
            InvalidArgumentError: lists for several groups; IndexError: an id out of range."""
        ids = list(block_ids)
        if ck.per_group(ids):
            if len(ids) != 1:
                raise _fail(InvalidArgumentError, f"block ids for {len(ids)} KV cache groups; the state layers are "
                            "in one")
            ids = [b for b in ids[0] if int(b) != NULL_BLOCK_ID]
        out = [ck.u32("block id", b) for b in ids]
        for b in out:
            if b >= self.num_blocks:
                raise IndexError(f"block id {b} out of range 0..{self.num_blocks}")
        return out

    def _bytes(self, t: Any) -> Any:
        """``t`` (host, contiguous) as bytes ``[blocks, bytes per block]``."""
        import torch

        return t.contiguous().view(torch.uint8).reshape(int(t.shape[0]), -1)

    def _count(self, ops: str, nbytes: str, slots: int, copies: int) -> None:
        with self._lock:
            self._counters[ops] += 1
            self._counters[nbytes] += slots * sum(self.part_bytes)
            self._counters["device_copies"] += copies

    def _torch_copies(self, ids: List[int], stage: bool) -> int:
        """``Tensor.copy_`` of each layer's tensors' blocks ``ids`` into their places in the
        mirror (``stage``) or back; one per run of consecutive ids and tensor. Returns the
        number of copies."""
        copies = 0
        for layer, ts in enumerate(self.tensors):
            m = self._mirrors[layer]
            for a, b in _runs(ids):
                for t, off, nb in zip(ts, self.offsets, self.part_bytes):
                    if stage:
                        m[a:b, off:off + nb].copy_(self._bytes(t[a:b].to("cpu")))
                    else:
                        d = t[a:b].view(_bits_of(t))
                        d.copy_(m[a:b, off:off + nb].contiguous().view(d.dtype).reshape(d.shape))
                    copies += 1
        return copies

    def stage(self, block_ids: Any) -> None:
        """:meth:`TorchKv.stage`: each layer's tensors' blocks ``block_ids`` into the mirror."""
        self.stage_async(block_ids)()

    def stage_async(self, block_ids: Any) -> Callable[[], None]:
        """:meth:`TorchKv.stage_async`."""
        if not len(block_ids):
            return _nothing
        ids = self._ids(block_ids)
        if not ids:
            return _nothing
        self.views()
        import torch

        self._hold(ids)
        n = len(ids) * len(self.tensors)
        if self._bt is None:
            self._count("stages", "d2h_bytes", n, self._torch_copies(ids, stage=True))
            return _nothing
        idx = torch.tensor(ids, dtype=torch.int64, device=self.device)
        src, dst, fills = [], [], []
        for layer, ts in enumerate(self.tensors):
            for t, off, nb in zip(ts, self.offsets, self.part_bytes):
                g = torch.index_select(t.view(_bits_of(t)), 0, idx)
                src.append(g)
                dst.append(torch.empty(g.shape, dtype=g.dtype, device="cpu"))
                fills.append((self._mirrors[layer], off, nb, dst[-1]))
        asynchronous = hasattr(self._bt, "batch_transfer_d2h")
        fut = (self._bt.batch_transfer_d2h(src, dst) if asynchronous else
               self._bt.batch_transfer_d2h_sync(src, dst))

        def finish() -> None:
            if asynchronous:
                fut.wait()  # keeps src and dst alive until the DMA is done
            for m, off, nb, d in fills:
                rows = self._bytes(d)
                for i, b in enumerate(ids):
                    m[b, off:off + nb].copy_(rows[i])
            self._count("stages", "d2h_bytes", n, len(src))

        return finish

    def commit(self, block_ids: Any) -> None:
        """:meth:`TorchKv.commit`: each layer's mirror slots ``block_ids`` into its tensors."""
        if not len(block_ids):
            return
        ids = self._ids(block_ids)
        if not ids:
            return
        self.views()
        import torch

        n = len(ids) * len(self.tensors)
        if self._bt is None:
            self._count("commits", "h2d_bytes", n, self._torch_copies(ids, stage=False))
            return
        hidx = torch.tensor(ids, dtype=torch.int64)
        idx = torch.tensor(ids, dtype=torch.int64, device=self.device)
        src, puts = [], []
        for layer, ts in enumerate(self.tensors):
            rows = torch.index_select(self._mirrors[layer], 0, hidx)
            for t, off, nb in zip(ts, self.offsets, self.part_bytes):
                bits = t.view(_bits_of(t))
                src.append(rows[:, off:off + nb].contiguous().view(bits.dtype).reshape((len(ids),) +
                                                                                    tuple(bits.shape[1:])))
                puts.append(bits)
        dev = [torch.empty(x.shape, dtype=x.dtype, device=self.device) for x in src]
        self._bt.batch_transfer_h2d_sync(src, dev)
        for t, d in zip(puts, dev):
            t.index_put_((idx,), d)
        self._count("commits", "h2d_bytes", n, len(src))

    def hold(self, block_ids: Any) -> None:
        """:meth:`TorchKv.hold`."""
        if not len(block_ids):
            return
        self.views()
        self._hold(self._ids(block_ids))

    def drop(self, block_ids: Any) -> None:
        """:meth:`TorchKv.drop`: the mirror pages of slots ``block_ids`` given back (all of
        them once no slot is in flight)."""
        if not self._maps or not len(block_ids):
            return
        # Any form the worker drops (its own group's list, or every group's ids flattened):
        # out-of-range ids are not this part's.
        with self._lock:
            _give_back(self._maps, ck.flat_block_ids(block_ids), self._inflight, self.block_bytes, self.num_blocks)

    def before_write(self, block_ids: Any, num_tokens: int, partial: Any = None) -> Tuple[int, ...]:
        """:meth:`TorchKv.before_write`: a pull writes every state byte of its slots, so nothing
        is staged first; the slots are held."""
        if len(block_ids):
            self.hold(block_ids)
        return ()

def _copy_api_for(copy_api: str, device: Any) -> Tuple[str, Any]:
    """``(copy API, torch_tpu's batch_transfer module or None)`` of ``framework-copy`` on
    ``device``: ``"auto"`` is ``batch_transfer`` on a ``tpu`` device where the module imports
    (a warning otherwise), else ``torch``.

    Raises:
        UnsupportedError: ``batch_transfer`` asked for where the module does not import."""
    if copy_api == "auto":
        if device.type == "tpu":
            try:
                return "batch_transfer", _import_batch_transfer()
            except ImportError as e:
                log.warning("tpu_sync.torch: %s does not import (%s): torch's copy_ instead", BATCH_TRANSFER_MODULE, e)
        return "torch", None
    if copy_api == "batch_transfer":
        try:
            return copy_api, _import_batch_transfer()
        except ImportError as e:
            raise _fail(UnsupportedError, f"copy_api batch_transfer: {BATCH_TRANSFER_MODULE} does not import "
                        f"({e})") from None
    return copy_api, None


def _mirror(nbytes: int) -> mmap.mmap:
    """A host mirror of ``nbytes``: page-aligned anonymous memory (``MAP_PRIVATE |
    MAP_ANONYMOUS``), zero until written, in small pages (a scattered block commits its own
    pages, not a 2 MiB one)."""
    m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return m


def _give_back(maps: Sequence[mmap.mmap], ids: Sequence[int], inflight: Set[int], block_bytes: int,
               num_blocks: int) -> None:
    """Takes blocks ``ids`` out of ``inflight`` and gives their mirror pages back
    (``MADV_DONTNEED``: they read as zero again): every page once nothing is in flight, else
    the whole pages inside each block not in flight (a neighbour in flight keeps its bytes).
    Ids outside ``0..num_blocks`` are not the mirrors'. The caller holds the lock."""
    inflight.difference_update(ids)
    if not inflight:
        for m in maps:
            m.madvise(mmap.MADV_DONTNEED)
        return
    page = mmap.PAGESIZE
    for b in ids:
        if not 0 <= b < num_blocks or b in inflight:
            continue
        lo = -(-(b * block_bytes) // page) * page
        hi = ((b + 1) * block_bytes // page) * page
        if hi > lo:
            for m in maps:
                m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _bits_of(t: Any) -> Any:
    """The integer dtype of ``t``'s element size (copies move bit patterns)."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[int(t.element_size())]


def _nothing() -> None:
    """The ``finish`` of a stage with nothing left to wait for."""


def _copy_runs(dsts: Sequence[Any], srcs: Sequence[Any], runs: Sequence[Tuple[int, int]]) -> None:
    """``dst[a:b].copy_(src[a:b])`` for every tensor pair and run of block ids."""
    for d, s in zip(dsts, srcs):
        for a, b in runs:
            d[a:b].copy_(s[a:b])


def _bundle_of(tensors: Sequence[Any]) -> Optional[Tuple[Any, int]]:
    """``(bundle, axis)``: the tensor whose index ``layer`` on axis ``axis`` is ``tensors[layer]``,
    viewed over the same storage, as vLLM-TorchTPU's block-major bundle binds its layers:
    ``[num_blocks, layers, ...]`` (axis 1) for the views ``bundle[:, layer]``, or ``[num_blocks,
    s, layers, ...]`` (axis 2) for those views of kernel pages seen as scheduler blocks
    (``[num_blocks, s, kernel_block_size, ...]``, each a block's ``s`` pages a bundle row apart).
    None when they are not exactly that (views of different tensors, another layer order or
    stride, a gap between layers). Only the tensors' metadata is read."""
    t0 = tensors[0]
    base = getattr(t0, "_base", None)
    n = len(tensors)
    if base is None or n < 2:
        return None
    for axis in (1, 2):
        if t0.dim() <= axis:
            break
        # unit: one layer's part of a bundle row (a block, or a kernel page)
        unit = int(t0[(0,) * axis].numel())
        outer = [int(d) for d in t0.shape[:axis]]
        # The rows of the bundle: row-major over the block dimensions, n units each.
        want = [n * unit * math.prod(outer[i + 1:]) for i in range(axis)]
        if [int(x) for x in t0.stride()[:axis]] != want:
            continue
        if any(getattr(t, "_base", None) is not base or tuple(t.stride()) != tuple(t0.stride())
               or int(t.storage_offset()) != int(t0.storage_offset()) + layer * unit
               for layer, t in enumerate(tensors)):
            continue  # e.g. kernel pages: a bundle row holds a page of each layer, not a block
        try:
            return (t0.as_strided(tuple(outer) + (n,) + tuple(t0.shape[axis:]),
                                  tuple(want) + (unit,) + tuple(t0.stride()[axis:])), axis)
        except RuntimeError as e:  # a framework that cannot view it: per-layer copies
            log.info("tpu_sync.torch: the bundle of the per-layer views cannot be viewed (%s): one copy per layer",
                     e)
            return None
    return None


def rows_contiguous(t: Any) -> bool:
    """Whether every block ``t[b]`` of a ``[num_blocks, ...]`` tensor is contiguous and blocks do
    not overlap (a contiguous tensor, or a strided view such as ``bundle[:, layer]``)."""
    if t.dim() < 2:
        return False
    return bool(t[0].is_contiguous()) and (t.shape[0] <= 1 or int(t.stride(0)) >= int(t[0].numel()))


def _import_batch_transfer() -> Any:
    import importlib

    mod = importlib.import_module(BATCH_TRANSFER_MODULE)
    for name in ("batch_transfer_d2h_sync", "batch_transfer_h2d_sync"):
        if not hasattr(mod, name):
            raise ImportError(f"{BATCH_TRANSFER_MODULE} has no {name}")
    return mod
