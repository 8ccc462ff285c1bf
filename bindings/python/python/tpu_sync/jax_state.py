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

Not wired into the vLLM connector yet: the worker still refuses a JAX runner whose model has
state groups (docs/tpu.md, "Not done yet").

Thread-safety: one :class:`JaxStateKv` per model-runner thread; its calls must not overlap a
forward that donates the caches.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import _check as ck
from .arrays import ITEMSIZE
from .errors import InvalidArgumentError, MismatchError, UnsupportedError
from .jax_kv import _axis_of, _fail, _uint

log = logging.getLogger("tpu_sync.jax")


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

    Raises:
        InvalidArgumentError: no state layers, an entry that is not a tuple of arrays, layers
            that differ (shapes, dtypes, shardings), slots larger than ``slot_bytes``, a view
            dtype that does not divide it; UnsupportedError: shardings not mapped (the module's
            docs); ImportError without jax.
    """

    def __init__(self, source: Any, layer_arrays: Sequence[int], slot_bytes: int, *, view_dtype: str = "u8",
                 model_axis: str = "model", data_axis: str = "data", client: Any = None,
                 setter: Optional[Callable[[int, Any], None]] = None) -> None:
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
        #: slots per shard (per DP replica); the methods take global slot ids
        self.num_blocks = self._comps[0][1][0]
        #: bytes of each component's shard in one slot, and where it starts in a mirror's slot
        self.part_bytes = [int(np.prod(shape[1:])) * item for _, shape, item in self._comps]
        self.offsets = [sum(self.part_bytes[:j]) for j in range(len(self._comps))]
        self.block_bytes = int(slot_bytes)
        if sum(self.part_bytes) > self.block_bytes:
            raise _fail(InvalidArgumentError, f"state shards of {sum(self.part_bytes)} B per slot in slots of "
                        f"{self.block_bytes} B")
        if view_dtype not in ITEMSIZE or self.block_bytes % ITEMSIZE[view_dtype]:
            raise _fail(InvalidArgumentError, f"view dtype {view_dtype!r} for slots of {self.block_bytes} B")
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
        src = self._source
        caches = src() if callable(src) and not hasattr(src, "kv_caches") else getattr(src, "kv_caches", None)
        if caches is None or len(caches) == 0:
            raise _fail(InvalidArgumentError, "the runner has no KV caches (runner.kv_caches is empty or unset)")
        return list(caches)

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

    def split(self, slot_ids: Sequence[int]) -> Tuple[int, List[int]]:
        """``(dp_rank, local slot ids)`` of global slot ids (one DP replica's).

        Raises:
            InvalidArgumentError: ids out of range, a slot named twice, or slots of several
                replicas."""
        ids = [ck.u32("slot id", b) for b in slot_ids]
        total = self.num_blocks * self.dp
        if any(b >= total for b in ids):
            raise _fail(InvalidArgumentError, f"slot id {max(ids)} out of range 0..{total}")
        if len(set(ids)) != len(ids):
            raise _fail(InvalidArgumentError, f"slot ids {ids} name a slot twice")
        reps = sorted({b // self.num_blocks for b in ids})
        if len(reps) > 1:
            raise _fail(InvalidArgumentError, f"slot ids {ids} lie in DP replicas {reps}: a request's slots are in "
                        "one replica's shard")
        d = reps[0] if reps else 0
        return d, [b - d * self.num_blocks for b in ids]

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
                        m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                        maps[r].append(m)
                        views[r].append(self.client.view(np.frombuffer(m, dtype=np.uint8), shape=shape,
                                                         dtype=self.buffer_dtype))
            except BaseException:
                for bufs in views.values():
                    for b in bufs:
                        b.close()
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

    def stage(self, slot_ids: Sequence[int]) -> None:
        """Copies slots ``slot_ids`` (global ids of one DP replica) of every state layer and rank
        into the host mirrors (a gather on the device, then JAX's D2H), each component's shard
        bytes at its offset in the slot, before tpu_sync reads them."""
        if not len(slot_ids):
            return
        import jax
        import numpy as np

        d, local = self.split(slot_ids)
        self.rank_views()
        if self._gather_fn is None:
            from jax import lax

            def gather(c: Any, i: Any) -> Any:
                # The bit patterns, gathered without a full-size copy of the shard.
                return lax.bitcast_convert_type(c, _uint(c.dtype.itemsize))[i]

            self._gather_fn = jax.jit(gather)
        ids = np.asarray(local, dtype=np.int32)
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

    def commit(self, slot_ids: Sequence[int]) -> None:
        """Writes slots ``slot_ids`` of the host mirrors into the state layers (JAX's H2D and a
        donating scatter per component; the layer's tuple in ``runner.kv_caches`` replaced) after
        tpu_sync wrote them.

        Raises:
            InvalidArgumentError: ids out of range, of several replicas, a slot named twice."""
        if not len(slot_ids):
            return
        import jax
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec

        d, local = self.split(slot_ids)
        self.rank_views()
        if self._scatter_fn is None:
            from jax import lax

            def scatter(c: Any, i: Any, u: Any) -> Any:
                # On the bit patterns: a floating-point scatter may canonicalise NaN payloads.
                bits = lax.bitcast_convert_type(c, u.dtype).at[i].set(u)
                return lax.bitcast_convert_type(bits, c.dtype)

            self._scatter_fn = jax.jit(scatter, donate_argnums=0)
        ids = np.asarray([d * self.num_blocks + b for b in local], dtype=np.int32)
        mirrors = self._mirror_slots()
        replica = self.replica_ranks(d)
        arrays = self.arrays()
        for layer, entry in enumerate(self._entries()):
            new = []
            for c, a in enumerate(entry):
                mdim, shape, item = self._comps[c]
                off = self.offsets[c]
                parts = {r % self.tp: np.ascontiguousarray(mirrors[r][layer][local, off:off + self.part_bytes[c]])
                         .view(_uint(item)).reshape((len(local),) + shape[1:]) for r in replica}
                glob = (len(local),) + tuple(int(x) for x in a.shape[1:])
                # The update's rows are not split over the data axis (global ids of one replica):
                # every device gets them all and the scatter writes those in its own shard.
                spec = list(getattr(a.sharding, "spec", ()) or ())
                spec += [None] * (len(glob) - len(spec))
                spec[0] = None
                sharding = NamedSharding(a.sharding.mesh, PartitionSpec(*spec))

                def piece(idx: Any, parts: Any = parts, mdim: Any = mdim, shape: Any = shape) -> Any:
                    t = (idx[mdim].start or 0) // shape[mdim] if mdim is not None else 0
                    return parts[t]

                upd = jax.make_array_from_callback(glob, sharding, piece)
                new.append(self._scatter_fn(a, ids, upd))
                self._counters["h2d_bytes"] += sum(p.nbytes for p in parts.values())
            i = self._index[layer]
            value = tuple(new) if isinstance(arrays[i], tuple) else list(new)
            if self._setter is not None:
                self._setter(i, value)
            else:
                self._source.kv_caches[i] = value
        self._counters["commits"] += 1

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

    def after_write(self, slot_ids: Sequence[int], ptrs: Tuple[int, ...] = ()) -> None:
        """After tpu_sync wrote slots ``slot_ids``: commits them into the state layers; the
        mirrors' pages are given back either way.

        Raises: JAX's errors from the copies, and :meth:`commit`'s."""
        try:
            self.commit(slot_ids)
        finally:
            self.drop(slot_ids)

    def close(self) -> None:
        """Closes the mirrors' views (the runner's arrays are untouched)."""
        if self._mirrors is not None:
            for bufs in self._mirrors[1].values():
                for b in bufs:
                    b.close()
            self._mirrors = None
