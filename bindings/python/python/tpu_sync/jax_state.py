"""Mamba / linear-attention state layers held as tuples of ``jax.Array`` s, as tpu-inference's
model runner holds a hybrid model's (issue 25; docs/tpu.md, tpu-inference's GDN hybrids).

A state layer's entry of ``runner.kv_caches`` is a tuple of arrays, one per state shape of the
layer's ``MambaSpec``, each ``(num_slots, *shape)`` (``runner/kv_cache_manager.py`` 0.32.0
``initialize_kv_cache``): a gated delta net's ``(conv_state, recurrent_state)``, conv
``[slots, state_len, conv_dim]`` sharded ``P("data", None, "model")`` and recurrent ``[slots,
heads, head_k_dim, head_v_dim]`` sharded ``P("data", "model", None, None)``. Every forward
re-assigns the tuple (donation), so this module reads ``runner.kv_caches`` again on every use,
as :class:`tpu_sync.jax_kv.JaxKv` does for the attention layers.

The shard of each component on TP rank ``t`` (of DP replica ``d``) is that rank's share of the
state, byte for byte vLLM's rank-``t`` slot (``tests/vllm/test_jax_runner.py::
test_tpu_inference_gdn_state_shards_are_the_connectors_rank_slots``). So tpu_sync sees each state
layer of each rank as one buffer ``[num_slots, slot_bytes / itemsize]`` whose slot holds the
components' shard bytes one after another from the slot's start: the layout of a state group's
slot (``tpu_sync.torch_kv.StateKv``, vLLM's state page), planned with the state components of the
model's hybrid layout, so a slot moves between tpu-inference runners of any TP, or between one and
an engine of another kind, like any state slot.

The buffers are host mirrors (anonymous memory, committed only for slots in flight) filled and
emptied by JAX's own copies, on any device: :meth:`JaxStateKv.stage` gathers slots on the device
and copies them to host before tpu_sync reads them; :meth:`JaxStateKv.commit` writes them back
by a jitted, donating scatter per component whose results replace the layer's tuple in the
runner. The copies move bit patterns (unsigned integers of the component's item size), so
floating-point values, NaN payloads included, arrive unchanged.

Data parallelism: with the ``data`` axis on the slots (dimension 0), DP replica ``d`` holds slots
``d * num_slots ..`` of the global arrays; the methods take global slot ids (as tpu-inference's
per-rank schedulers number them after its merge), one request's slots in one replica, and
tpu_sync rank ``d * tp + t`` is TP rank ``t`` of replica ``d``.

Not mapped (refused with the reason): a component replicated over the ``model`` axis while TP
is above 1, the slots split over the ``model`` axis or over any axis but ``data``, a shard on
more than one device (another mesh axis in play).

The vLLM connector's worker uses it through :class:`JaxHybridKv` for P/D of such models, whose
state lives in runner-owned slots (tpu-inference's ``mamba_cache_mode="none"``): the mirrors'
rows are then the state group's scheduler block ids, and each copy names the device slot the
runner gave the request (docs/tpu.md).

Thread-safety: one :class:`JaxStateKv` per model-runner thread; its calls must not overlap a
forward that donates the caches.
"""

from __future__ import annotations

import logging
import mmap
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import _check as ck
from .arrays import ITEMSIZE
from .errors import InvalidArgumentError, MismatchError, UnsupportedError
from .jax_kv import _axis_of, _fail, _uint, close_buffers, runner_caches, set_runner_cache

log = logging.getLogger("tpu_sync.jax")

#: Linux's ``MAP_NORESERVE`` (Python's mmap module does not name it)
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


class JaxStateKv:
    """A model runner's state layers (tuples of ``jax.Array`` s in ``runner.kv_caches``), read
    lazily, moved through JAX's copies into host mirrors of tpu_sync's slot layout.

    Args:
        source: the runner (its ``kv_caches`` attribute is read on every use) or a callable
            returning the list; :meth:`commit` writes a layer's new tuple back through
            ``runner.kv_caches[i] = ...`` (a callable source needs ``setter``).
        layer_arrays: the index in the runner's list of each state layer's tuple, in the order
            of the state group's layers (tpu-inference's ``runner.layer_name_to_kvcache_index``).
        slot_bytes: the mirrors' slot stride in bytes (>= the components' shard bytes per slot
            together, a multiple of ``view_dtype``'s size): the state group's ``slot_bytes`` in
            tpu_sync's layout.
        view_dtype: the tpu_sync dtype of the buffers (default ``u8``).
        model_axis, data_axis: the mesh axis names of TP and DP (tpu-inference's defaults).
        client: the tpu_sync client that views the mirrors (default: a new one on the XLA CPU
            plugin).
        setter: ``setter(index, tuple_of_arrays)`` for a callable source.
        mirror_blocks: rows of the mirrors per DP replica (default: the state's slots per
            shard). The mirrors' rows are what tpu_sync's placements name; where they are not
            the device's slots (tpu-inference's runner-owned slots: the rows are the state
            group's scheduler block ids), :meth:`stage` and :meth:`commit` take the device slot
            of each row.

    Raises:
        InvalidArgumentError: no state layers, an entry that is not a tuple of arrays, layers
            that differ (shapes, dtypes, shardings), slots larger than ``slot_bytes``, a view
            dtype that does not divide it; UnsupportedError: shardings not mapped (the module's
            docs); ImportError without jax.
    """

    def __init__(self, source: Any, layer_arrays: Sequence[int], slot_bytes: int, *, view_dtype: str = "u8",
                 model_axis: str = "model", data_axis: str = "data", client: Any = None,
                 setter: Optional[Callable[[int, Any], None]] = None, mirror_blocks: Optional[int] = None) -> None:
        import jax  # noqa: F401  (needed by every method; fail early without it)
        import numpy as np

        self._source, self._setter = source, setter
        self.model_axis, self.data_axis = model_axis, data_axis
        caches = self.arrays()
        self._index = [int(i) for i in layer_arrays]
        bad = [i for i in self._index if not 0 <= i < len(caches)]
        if not self._index or bad or len(set(self._index)) != len(self._index):
            raise _fail(InvalidArgumentError, f"state layer arrays {self._index} for a runner of {len(caches)} "
                        "entries (each state layer's own entry, at least one)")
        first = caches[self._index[0]]
        if not isinstance(first, (tuple, list)) or not first:
            raise _fail(InvalidArgumentError, f"runner.kv_caches[{self._index[0]}] is {type(first).__name__}, not "
                        "a state layer's tuple of arrays")

        def geometry(entry: Any) -> List[Tuple[Any, ...]]:
            return [(tuple(a.shape), str(a.dtype), a.sharding) for a in entry]

        want = geometry(first)
        for i in self._index:
            e = caches[i]
            if not isinstance(e, (tuple, list)) or geometry(e) != want:
                got = geometry(e) if isinstance(e, (tuple, list)) else type(e).__name__
                raise _fail(InvalidArgumentError, f"runner.kv_caches[{i}]: {got} differs from state layer "
                            f"{self._index[0]}'s {want}")
        mesh = getattr(first[0].sharding, "mesh", None)
        sizes = dict(mesh.shape) if mesh is not None else {}
        self.tp = int(sizes.get(model_axis, 1))
        self.dp = None
        #: per component: (dimension split over the model axis or None, shard shape, item size)
        self._comps: List[Tuple[Optional[int], Tuple[int, ...], int]] = []
        #: per component: tpu_sync rank -> device of its shard
        self._device_of: List[Dict[int, Any]] = []
        for c, a in enumerate(first):
            if getattr(a.sharding, "mesh", None) is not mesh:
                raise _fail(UnsupportedError, f"state component {c} is on another mesh than component 0")
            spec = tuple(getattr(a.sharding, "spec", ()) or ())
            ddim, mdim = _axis_of(spec, data_axis), _axis_of(spec, model_axis)
            dp = 1
            if ddim is not None:
                entry = spec[ddim]
                for name in (entry if isinstance(entry, tuple) else (entry,)):
                    dp *= int(sizes.get(name, 1))
            if dp > 1 and ddim != 0:
                raise _fail(UnsupportedError, f"state component {c} {tuple(a.shape)} is split over {data_axis!r} on "
                            f"dimension {ddim}: only a split of the slots (dimension 0) is mapped")
            if self.dp is not None and dp != self.dp:
                raise _fail(UnsupportedError, f"state component {c} is split into {dp} data-parallel shards, "
                            f"component 0 into {self.dp}")
            self.dp = dp
            if self.tp > 1 and mdim in (None, 0):
                what = "replicated over" if mdim is None else "split on its slots over"
                raise _fail(UnsupportedError, f"state component {c} {tuple(a.shape)} is {what} the {model_axis!r} "
                            f"axis of {self.tp} devices: only a split of the state itself (its channels or heads) "
                            "is mapped")
            shards = list(a.addressable_shards)
            shape = tuple(int(x) for x in shards[0].data.shape)
            if shape[0] * dp != int(a.shape[0]):
                raise _fail(UnsupportedError, f"state component {c}: shards of {shape[0]} slots of {int(a.shape[0])} "
                            f"for {dp} data-parallel replicas: a split of the slots over other mesh axes is not "
                            "mapped")
            where: Dict[int, Any] = {}
            for s in shards:
                t = (s.index[mdim].start or 0) // shape[mdim] if mdim is not None else 0
                d = (s.index[0].start or 0) // shape[0] if dp > 1 else 0
                r = d * self.tp + t
                if r in where:
                    raise _fail(UnsupportedError, f"state component {c}: rank {r}'s shard is on more than one "
                                "device (another mesh axis in play): not mapped")
                where[r] = s.device
            self._comps.append((mdim, shape, int(np.dtype(a.dtype).itemsize)))
            self._device_of.append(where)
        self.dp = self.dp or 1
        #: tpu_sync ranks held here (``dp_rank * tp + tp_rank``)
        self.ranks: List[int] = sorted(self._device_of[0])
        if any(sorted(w) != self.ranks for w in self._device_of):
            raise _fail(UnsupportedError, "the state components are split over different ranks")
        #: the state's slots per shard (per DP replica)
        self.device_slots = self._comps[0][1][0]
        #: the mirrors' rows per DP replica (what placements name); the methods take global rows
        self.num_blocks = self.device_slots if mirror_blocks is None else int(mirror_blocks)
        if self.num_blocks < 1:
            raise _fail(InvalidArgumentError, f"mirror_blocks {mirror_blocks}")
        #: bytes of each component's shard in one slot, and where it starts in a mirror's slot
        self.part_bytes = [int(np.prod(shape[1:])) * item for _, shape, item in self._comps]
        self.block_bytes = int(slot_bytes)
        self.offsets = ck.state_slot(self.part_bytes, self.block_bytes, view_dtype, "state shards")
        self.buffer_dtype = view_dtype
        self.num_layers = len(self._index)
        self.backend, self.backend_reason = "framework-copy", "a state layer is several arrays: JAX's own copies"
        if client is None:
            import tpu_sync

            client = tpu_sync.Client()
        self.client = client
        self._mirrors: Optional[Tuple[Dict[int, List[Any]], Dict[int, List[Any]]]] = None
        self._gather_fn: Any = None
        self._scatter_fn: Any = None
        self._counters = dict(d2h_bytes=0, h2d_bytes=0, stages=0, commits=0)
        log.info("tpu_sync.jax: %d state layers of %d components (%s B a slot per rank), TP=%d, DP=%d, %d slots "
                 "per shard; JAX's copies into host mirrors", self.num_layers, len(self._comps),
                 "+".join(map(str, self.part_bytes)), self.tp, self.dp, self.num_blocks)

    # -- the caches ---------------------------------------------------------------------------

    def arrays(self) -> List[Any]:
        """The runner's current list (read again on every call)."""
        return runner_caches(self._source)

    def stats(self) -> Dict[str, Any]:
        """Back end, geometry and counters (bytes copied by JAX's copies, stages, commits)."""
        return dict(self._counters, backend=self.backend, backend_reason=self.backend_reason, tp=self.tp, dp=self.dp,
                    ranks=list(self.ranks), part_bytes=list(self.part_bytes), slot_bytes=self.block_bytes)

    def _entries(self) -> List[Any]:
        """Each state layer's current tuple, checked against the geometry seen at start."""
        arrays = self.arrays()
        out = []
        for i in self._index:
            e = arrays[i]
            if not isinstance(e, (tuple, list)) or len(e) != len(self._comps):
                raise _fail(MismatchError, f"runner.kv_caches[{i}] is no longer a tuple of {len(self._comps)} arrays")
            for c, a in enumerate(e):
                shard = tuple(int(x) for x in a.addressable_shards[0].data.shape)
                if shard != self._comps[c][1]:
                    raise _fail(MismatchError, f"runner.kv_caches[{i}] component {c}: shards of {shard}, expected "
                                f"{self._comps[c][1]} (the runner's state changed its sharding or shape)")
            out.append(e)
        return out

    def _shard(self, a: Any, c: int, rank: int) -> Any:
        dev = self._device_of[c][rank]
        for s in a.addressable_shards:
            if s.device == dev:
                return s.data
        raise _fail(MismatchError, f"state component {c}: no shard on {dev} (rank {rank}) any more")

    # -- slot ids -----------------------------------------------------------------------------

    def replica_ranks(self, dp_rank: int) -> List[int]:
        """The ranks of DP replica ``dp_rank`` held here (``dp_rank * tp + t``)."""
        return [r for r in self.ranks if r // self.tp == dp_rank]

    def split(self, slot_ids: Sequence[int], per_replica: Optional[int] = None) -> Tuple[int, List[int]]:
        """``(dp_rank, local ids)`` of global mirror rows (``per_replica``: of device slots, with
        :attr:`device_slots` a replica) of one DP replica.

        Raises:
            InvalidArgumentError: ids out of range, an id named twice, or ids of several
                replicas."""
        n = self.num_blocks if per_replica is None else int(per_replica)
        ids = [ck.u32("slot id", b) for b in slot_ids]
        total = n * self.dp
        if any(b >= total for b in ids):
            raise _fail(InvalidArgumentError, f"slot id {max(ids)} out of range 0..{total}")
        if len(set(ids)) != len(ids):
            raise _fail(InvalidArgumentError, f"slot ids {ids} name a slot twice")
        reps = sorted({b // n for b in ids})
        if len(reps) > 1:
            raise _fail(InvalidArgumentError, f"slot ids {ids} lie in DP replicas {reps}: a request's slots are in "
                        "one replica's shard")
        d = reps[0] if reps else 0
        return d, [b - d * n for b in ids]

    def _rows_and_slots(self, rows: Sequence[int], device_slots: Optional[Sequence[int]]
                        ) -> Tuple[int, List[int], List[int]]:
        """``(dp_rank, local mirror rows, local device slots)`` of global rows and their device
        slots (default: the rows themselves), one replica's."""
        d, local = self.split(rows)
        if device_slots is None:
            if self.num_blocks != self.device_slots:
                raise _fail(InvalidArgumentError, "the mirrors' rows are not the device's slots: name each row's slot")
            return d, local, list(local)
        if len(device_slots) != len(local):
            raise _fail(InvalidArgumentError, f"{len(device_slots)} device slots for {len(local)} rows")
        ds, slots = self.split(device_slots, self.device_slots)
        if slots and ds != d:
            raise _fail(InvalidArgumentError, f"rows of DP replica {d}, device slots of replica {ds}")
        return d, local, slots

    # -- host mirrors -------------------------------------------------------------------------

    def rank_views(self) -> Dict[int, List[Any]]:
        """Rank -> per-layer PJRT buffers ``[num_slots, slot_bytes / itemsize]`` over the host
        mirrors (anonymous memory, committed only where :meth:`stage` or a transfer wrote, given
        back by :meth:`drop`). :meth:`stage` slots before tpu_sync reads them, :meth:`commit`
        them after it wrote them."""
        if self._mirrors is None:
            import mmap

            import numpy as np

            nbytes = self.num_blocks * self.block_bytes
            shape = (self.num_blocks, self.block_bytes // ITEMSIZE[self.buffer_dtype])
            maps: Dict[int, List[Any]] = {}
            views: Dict[int, List[Any]] = {}
            try:
                for r in self.ranks:
                    maps[r], views[r] = [], []
                    for _ in range(self.num_layers):
                        # Address space only: rows are committed where a copy writes them
                        # (MAP_NORESERVE: a pool of many blocks never counts against overcommit).
                        m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
                        maps[r].append(m)
                        views[r].append(self.client.view(np.frombuffer(m, dtype=np.uint8), shape=shape,
                                                         dtype=self.buffer_dtype))
            except BaseException:
                close_buffers(views)
                raise
            self._mirrors = (maps, views)
        return self._mirrors[1]

    def replica_views(self, dp_rank: int) -> Dict[int, List[Any]]:
        """:meth:`rank_views` of DP replica ``dp_rank``'s ranks (a placement in that replica)."""
        keep = set(self.replica_ranks(dp_rank))
        return {r: v for r, v in self.rank_views().items() if r in keep}

    def _mirror_slots(self) -> Dict[int, List[Any]]:
        import numpy as np

        assert self._mirrors is not None
        return {r: [np.frombuffer(m, dtype=np.uint8).reshape(self.num_blocks, self.block_bytes) for m in ms]
                for r, ms in self._mirrors[0].items()}

    def stage(self, slot_ids: Sequence[int], device_slots: Optional[Sequence[int]] = None) -> None:
        """Copies the device's slots ``device_slots`` (default: ``slot_ids``) of every state
        layer and rank into mirror rows ``slot_ids`` (global ids of one DP replica; a gather on
        the device, then JAX's D2H), each component's shard bytes at its offset in the row,
        before tpu_sync reads them."""
        if not len(slot_ids):
            return
        import jax
        import numpy as np

        d, local, slots = self._rows_and_slots(slot_ids, device_slots)
        self.rank_views()
        if self._gather_fn is None:
            from jax import lax

            def gather(c: Any, i: Any) -> Any:
                # The bit patterns, gathered without a full-size copy of the shard.
                return lax.bitcast_convert_type(c, _uint(c.dtype.itemsize))[i]

            self._gather_fn = jax.jit(gather)
        ids = np.asarray(slots, dtype=np.int32)
        mirrors = self._mirror_slots()
        for layer, entry in enumerate(self._entries()):
            for r in self.replica_ranks(d):
                for c, a in enumerate(entry):
                    shard = self._shard(a, c, r)
                    host = np.asarray(jax.device_get(self._gather_fn(shard, ids)))
                    off = self.offsets[c]
                    mirrors[r][layer][local, off:off + self.part_bytes[c]] = host.reshape(len(local), -1).view(np.uint8)
                    self._counters["d2h_bytes"] += host.nbytes
        self._counters["stages"] += 1

    def commit(self, slot_ids: Sequence[int], device_slots: Optional[Sequence[int]] = None) -> None:
        """Writes mirror rows ``slot_ids`` into the device's slots ``device_slots`` (default: the
        same ids) of the state layers (JAX's H2D and a donating scatter per component; the
        layer's tuple in ``runner.kv_caches`` replaced) after tpu_sync wrote them. If a copy
        fails, the runner still gets a valid tuple (the components written so far, the others
        as they were) and the error is raised.

        Raises:
            InvalidArgumentError: ids out of range, of several replicas, a slot named twice;
            JAX's errors from the copies."""
        if not len(slot_ids):
            return
        import jax
        import numpy as np

        d, local, slots = self._rows_and_slots(slot_ids, device_slots)
        self.rank_views()
        if self._scatter_fn is None:
            from jax import lax

            def scatter(c: Any, i: Any, u: Any) -> Any:
                # On the bit patterns: a floating-point scatter may canonicalise NaN payloads.
                bits = lax.bitcast_convert_type(c, u.dtype).at[i].set(u)
                return lax.bitcast_convert_type(bits, c.dtype)

            self._scatter_fn = jax.jit(scatter, donate_argnums=0)
        ids = np.asarray([d * self.device_slots + b for b in slots], dtype=np.int32)
        mirrors = self._mirror_slots()
        arrays = self.arrays()
        for layer, entry in enumerate(self._entries()):
            i = self._index[layer]
            new: List[Any] = []
            try:
                for c, a in enumerate(entry):
                    rows = {r % self.tp: mirrors[r][layer][local] for r in self.replica_ranks(d)}
                    new.append(self._scatter_fn(a, ids, self._update(c, a, rows)))
            finally:
                # The components scattered so far were donated: the runner gets their results
                # and the others' old arrays, so no entry holds a deleted array, even on failure.
                done = list(new) + list(entry[len(new):])
                set_runner_cache(self._source, self._setter, i,
                                 tuple(done) if isinstance(arrays[i], tuple) else done)
        self._counters["commits"] += 1

    def _update(self, c: int, a: Any, rows: Dict[int, Any]) -> Any:
        """Component ``c``'s update for a scatter into its global array ``a``: TP rank ``t``'s
        shard from ``rows[t]`` (its mirror rows, ``[n, slot_bytes]`` bytes), the rows
        replicated over the data axis (global ids of one replica: every device gets them all
        and the scatter writes those in its own shard)."""
        import jax
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec

        mdim, shape, item = self._comps[c]
        off = self.offsets[c]
        n = len(next(iter(rows.values())))
        parts = {t: np.ascontiguousarray(m[:, off:off + self.part_bytes[c]]).view(_uint(item))
                 .reshape((n,) + shape[1:]) for t, m in rows.items()}
        glob = (n,) + tuple(int(x) for x in a.shape[1:])
        spec = list(getattr(a.sharding, "spec", ()) or ())
        spec += [None] * (len(glob) - len(spec))
        spec[0] = None

        def piece(idx: Any) -> Any:
            return parts[(idx[mdim].start or 0) // shape[mdim] if mdim is not None else 0]

        upd = jax.make_array_from_callback(glob, NamedSharding(a.sharding.mesh, PartitionSpec(*spec)), piece)
        self._counters["h2d_bytes"] += sum(p.nbytes for p in parts.values())
        return upd

    def hold(self, slot_ids: Any) -> None:
        """Nothing to do: :meth:`drop` gives back only the pages of the slots it names."""

    def drop(self, slot_ids: Sequence[int]) -> None:
        """Gives the host memory of slots ``slot_ids``' mirror pages back (``madvise(
        MADV_DONTNEED)``: they read as zero again), so the mirrors hold only slots in flight."""
        if self._mirrors is None or not len(slot_ids):
            return
        import mmap

        page = mmap.PAGESIZE
        for r, ms in self._mirrors[0].items():
            for m in ms:
                for g in (int(b) for b in slot_ids):
                    if g // self.num_blocks != r // self.tp:
                        continue  # another DP replica's slot
                    b = g % self.num_blocks
                    lo = -(-(b * self.block_bytes) // page) * page
                    hi = ((b + 1) * self.block_bytes // page) * page
                    if hi > lo:
                        m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def before_write(self, slot_ids: Any, num_tokens: int, partial: Any = None) -> Tuple[int, ...]:
        """Before tpu_sync writes slots ``slot_ids``: nothing to stage (a state slot is always
        written whole). Returns ``()`` for :meth:`after_write`."""
        return ()

    def after_write(self, slot_ids: Sequence[int], ptrs: Tuple[int, ...] = (),
                    device_slots: Optional[Sequence[int]] = None) -> None:
        """After tpu_sync wrote mirror rows ``slot_ids``: commits them into the device's slots
        (``device_slots``, default the same ids); the mirrors' pages are given back either way.

        Raises: JAX's errors from the copies, and :meth:`commit`'s."""
        try:
            self.commit(slot_ids, device_slots)
        finally:
            self.drop(slot_ids)

    def close(self) -> None:
        """Closes the mirrors' views (the runner's arrays are untouched)."""
        mirrors, self._mirrors = self._mirrors, None
        if mirrors is not None:
            close_buffers(mirrors[1])


class JaxHybridKv:
    """A tpu-inference runner's attention caches (:class:`tpu_sync.jax_kv.JaxKv`) and its
    state layers (one :class:`JaxStateKv` per state group) behind :class:`~tpu_sync.jax_kv.JaxKv`'s
    interface, as the vLLM connector's worker uses it for a hybrid model (docs/tpu.md).

    tpu_sync sees every cache layer in cache-layer order: the attention layers' buffers (the
    shards, or their mirrors) and the state layers' mirrors, whose rows are the state groups'
    scheduler block ids (what the connector's placements name). The device state of a request
    lives in a slot its runner owns (``mamba_cache_mode="none"``: assigned when the request
    enters the persistent batch, given back when it leaves), which ``slot_of(req_id)`` finds
    (None while the request is not in the batch). So before a request's blocks are staged or
    written, :meth:`map_request` binds its state rows to its slot: a producer stages the state
    while the request is still in the batch (the connector registers it right after the forward
    that completes its prefill); a consumer's pulled state stays in its rows until the request
    enters the batch, and :meth:`commit_pending` (each step once the runner placed its requests,
    before the forward: vLLM's ``bind_connector_metadata``) writes it into the slot then.

    Args:
        attn: the attention layers' caches (their own KV cache groups numbered ``0..``).
        states: per state group (the geometry's group index), its state layers.
        layer_kinds: per cache layer, ``(group index, position in its part)``: the part is
            ``attn`` for an attention group, else that state group's :class:`JaxStateKv`.
        groups: the geometry's KV cache groups in order, each ``"attention"`` or ``"state"``.
        slot_of: ``slot_of(req_id)``: the request's global device slot, or None.

    Thread-safety: as :class:`JaxStateKv`.
    """

    def __init__(self, attn: Any, states: Dict[int, JaxStateKv], layer_kinds: Sequence[Tuple[int, int]],
                 groups: Sequence[str], slot_of: Callable[[str], Optional[int]]) -> None:
        self.attn, self.states = attn, dict(states)
        self._layers = [(int(g), int(p)) for g, p in layer_kinds]
        self._groups = list(groups)
        self._attn_groups = [i for i, k in enumerate(self._groups) if k != "state"]
        self._slot_of = slot_of
        for g, st in self.states.items():
            if (st.tp, st.dp, st.ranks, st.num_blocks) != (attn.tp, attn.dp, attn.ranks, attn.num_blocks):
                raise _fail(InvalidArgumentError, f"state group {g}: TP {st.tp}, DP {st.dp}, ranks {st.ranks}, "
                            f"{st.num_blocks} rows a replica; the attention caches: TP {attn.tp}, DP {attn.dp}, "
                            f"ranks {attn.ranks}, {attn.num_blocks} blocks")
        for name in ("tp", "dp", "ranks", "num_blocks", "mla", "view_shape", "model_dtype", "buffer_dtype",
                     "client", "backend", "backend_reason", "block_size", "physical_layout"):
            setattr(self, name, getattr(attn, name))
        self.num_layers = len(self._layers)
        #: (state group, global row) -> global device slot, for the next copies of those rows
        self._slots: Dict[Tuple[int, int], Optional[int]] = {}
        #: req_id -> {state group: rows} pulled and waiting for the request's slot
        self._pending: Dict[str, Dict[int, List[int]]] = {}

    # -- JaxKv's interface ----------------------------------------------------------------------

    def split(self, block_ids: Sequence[int]) -> Tuple[int, List[int]]:
        return self.attn.split(block_ids)

    def replica_ranks(self, dp_rank: int) -> List[int]:
        return self.attn.replica_ranks(dp_rank)

    def _merge(self, attn: Dict[int, List[Any]], states: Dict[int, Dict[int, List[Any]]]) -> Dict[int, List[Any]]:
        out: Dict[int, List[Any]] = {}
        for r in attn:
            out[r] = [attn[r][p] if self._groups[g] != "state" else states[g][r][p] for g, p in self._layers]
        return out

    def rank_views(self) -> Dict[int, List[Any]]:
        """Rank -> every cache layer's buffer, in cache-layer order."""
        return self._merge(self.attn.rank_views(), {g: st.rank_views() for g, st in self.states.items()})

    def replica_views(self, dp_rank: int) -> Dict[int, List[Any]]:
        return self._merge(self.attn.replica_views(dp_rank),
                           {g: st.replica_views(dp_rank) for g, st in self.states.items()})

    def pointers(self) -> Tuple[int, ...]:
        return self.attn.pointers()

    def stats(self) -> Dict[str, Any]:
        return dict(self.attn.stats(), states={str(g): st.stats() for g, st in self.states.items()},
                    pending_state_requests=len(self._pending))

    def _attn_ids(self, block_ids: Any) -> Any:
        ids = list(block_ids)
        if ids and isinstance(ids[0], (list, tuple)):
            return [list(ids[g]) for g in self._attn_groups]
        return ids

    def _state_rows(self, block_ids: Any) -> Dict[int, List[int]]:
        ids = list(block_ids)
        if not ids or not isinstance(ids[0], (list, tuple)):
            return {}
        return {g: [int(b) for b in ids[g] if int(b) != ck.NULL_BLOCK_ID] for g in self.states}

    def map_request(self, req_id: str, block_ids: Any) -> None:
        """Binds request ``req_id``'s state rows (its state groups' block ids in ``block_ids``,
        one list per KV cache group) to its device slot, as the runner has it now (None: the
        request is not in the runner's batch)."""
        slot = self._slot_of(req_id)
        for g, rows in self._state_rows(block_ids).items():
            if len(rows) > 1:
                raise _fail(InvalidArgumentError, f"request {req_id}: {len(rows)} blocks {rows} in state group {g}; "
                            "one state slot per request is moved")
            for row in rows:
                self._slots[(g, row)] = slot

    def _state_slots(self, g: int, rows: List[int]) -> List[int]:
        slots = [self._slots.get((g, r)) for r in rows]
        if any(s is None for s in slots):
            raise RuntimeError(f"state group {g}: rows {rows} have no device slot (the request is not in the "
                               "runner's batch: its state is gone or not there yet)")
        return [int(s) for s in slots]  # type: ignore[arg-type]

    def _unmap(self, g: int, rows: List[int]) -> None:
        for r in rows:
            self._slots.pop((g, r), None)

    def stage(self, block_ids: Any) -> None:
        """The attention blocks (:meth:`JaxKv.stage`) and each state group's rows from the
        device slots :meth:`map_request` bound them to.

        Raises:
            RuntimeError: a state row without a device slot (the request left the batch)."""
        self.attn.stage(self._attn_ids(block_ids))
        for g, rows in self._state_rows(block_ids).items():
            if rows:
                try:
                    self.states[g].stage(rows, self._state_slots(g, rows))
                finally:
                    self._unmap(g, rows)

    def commit(self, block_ids: Any) -> None:
        self.attn.commit(self._attn_ids(block_ids))
        for g, rows in self._state_rows(block_ids).items():
            if rows:
                try:
                    self.states[g].commit(rows, self._state_slots(g, rows))
                finally:
                    self._unmap(g, rows)

    def hold(self, block_ids: Any) -> None:
        """Nothing to do (as :meth:`JaxKv.hold`)."""

    def drop(self, block_ids: Any) -> None:
        """Gives the mirrors' pages of ``block_ids`` back (a flat list, or one per group: every
        id is dropped in every part, as the worker's flat lists need; in ``mamba_cache_mode=
        "none"`` the state group's blocks come from the pool the attention groups share, so no
        id names two groups' blocks at once), but never the rows of a pulled state still
        waiting for its request's slot."""
        flat = ck.flat_block_ids(block_ids)
        self.attn.drop(flat)
        waiting = {(g, r) for rows in self._pending.values() for g, rs in rows.items() for r in rs}
        for g, st in self.states.items():
            st.drop([b for b in flat if (g, b) not in waiting])

    def before_write(self, block_ids: Any, num_tokens: int, partial: Any = None) -> Tuple[int, ...]:
        return self.attn.before_write(self._attn_ids(block_ids), num_tokens,
                                      None if partial is None else self._attn_ids(partial))

    def after_write(self, block_ids: Any, ptrs: Tuple[int, ...], req_id: Optional[str] = None) -> None:
        """After a pull wrote ``block_ids``: the attention blocks committed (:meth:`JaxKv.after_write`),
        each state row committed into its request's slot if the request is in the runner's batch,
        else kept for :meth:`commit_pending` (``req_id`` names the request)."""
        try:
            self.attn.after_write(self._attn_ids(block_ids), ptrs)
        except BaseException:
            for g, rows in self._state_rows(block_ids).items():
                self.states[g].drop(rows)
                self._unmap(g, rows)
            raise
        later: Dict[int, List[int]] = {}
        for g, rows in self._state_rows(block_ids).items():
            if not rows:
                continue
            try:
                if all(self._slots.get((g, r)) is not None for r in rows):
                    self.states[g].after_write(rows, (), self._state_slots(g, rows))
                else:
                    later[g] = rows
            finally:
                self._unmap(g, rows)
        if later:
            if req_id is None:
                for g, rows in later.items():
                    self.states[g].drop(rows)
                raise RuntimeError("a pulled state without its request's slot and no request to wait for")
            self._pending[req_id] = later

    def commit_pending(self) -> List[str]:
        """Writes each pulled state whose request has entered the runner's batch into its
        slot; returns those requests. Call it after the runner placed this step's requests and
        before the forward reads their slots (vLLM's ``bind_connector_metadata``).

        Raises:
            RuntimeError: a state could not be written (JAX's copies failed), naming the
                requests, after every other request's state was written: the pull was already
                reported done, so the request would otherwise compute from whatever its slot
                held. The runner's arrays stay valid (:meth:`JaxStateKv.commit`)."""
        done, failed = [], []
        for req_id, rows in list(self._pending.items()):
            slot = self._slot_of(req_id)
            if slot is None:
                continue
            del self._pending[req_id]
            try:
                for g, rs in rows.items():
                    self.states[g].after_write(rs, (), [int(slot)] * len(rs))
                done.append(req_id)
            except Exception as e:  # noqa: BLE001  (every other request's state still written)
                log.error("tpu_sync.jax: the pulled state of %s could not be written into slot %d: %s", req_id,
                          slot, e)
                failed.append(f"{req_id} ({e})")
                for g, rs in rows.items():
                    self.states[g].drop(rs)
        if failed:
            raise RuntimeError("pulled states not written into their requests' slots: " + "; ".join(failed))
        return done

    def forget(self, req_id: str) -> None:
        """Drops a request's pulled state still waiting for its slot (it finished or was
        aborted first)."""
        rows = self._pending.pop(req_id, None)
        for g, rs in (rows or {}).items():
            self.states[g].drop(rs)

    def close(self) -> None:
        for st in self.states.values():
            st.close()
        self.attn.close()
