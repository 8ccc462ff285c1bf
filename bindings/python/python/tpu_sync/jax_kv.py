"""KV caches held as ``jax.Array`` s, as tpu-inference's model runner holds them (issue 25).

tpu-inference 0.32 never calls ``register_kv_caches``: its connectors get the runner through
``register_runner(runner)``, and ``runner.kv_caches`` is a ``list[jax.Array]``, one per layer, that
every forward re-assigns (the caches are donated to the jitted step, ``tpu_inference/runner/
tpu_runner.py``). So this module never keeps an array: :class:`JaxKv` reads ``runner.kv_caches``
again whenever it is used.

Each layer's array is the ragged paged attention v3 cache ``[num_blocks, block_size, R, P, D']``
(``tpu_sync.layout(..., order="rpa3")``; docs/tpu.md), sharded ``NamedSharding(mesh,
P("data", None, "model"))`` (``tpu_inference/layers/common/sharding.py``): dimension 2 (the
packed K/V head rows) over the ``model`` axis, one TP rank per shard, each shard padded to ``P``
on its own, so a shard is exactly tpu_sync's per-rank RPA v3 buffer of ``heads / TP`` heads.

Two back ends move the bytes (:attr:`JaxKv.backend`, with the reason in
:attr:`JaxKv.backend_reason` and in :meth:`JaxKv.stats`):

* ``"pjrt-view"``: the shards' own memory, viewed without a copy as PJRT buffers of tpu_sync's
  client (:meth:`tpu_sync.Client.view` over ``unsafe_buffer_pointer()``). Only where the shards
  are in host memory (JAX's CPU devices): a TPU shard's pointer is HBM, which only its own PJRT
  client can address (the native shim of issue 25, not built yet, hands those ``PJRT_Buffer*``
  over through :meth:`tpu_sync.Client.adopt_buffer`).
* ``"framework-copy"``: JAX's own copies, on any device. A register gathers the request's blocks
  on the device (``cache[ids]``) and copies them to host (``jax.device_get``) into host mirrors
  of the shards (same block ids; memory committed only while a transfer is in flight), which
  tpu_sync reads; a pull lands in the mirrors and is written into the caches by a jitted,
  donating scatter (``cache.at[ids].set(...)``) whose results replace ``runner.kv_caches[l]``.
  One more host copy than ``pjrt-view``.

MLA models: tpu-inference's MLA cache is ``[num_blocks, block_size / K, K, D']`` per layer
(``kernels/mla/v2/kernel.py`` ``get_kv_cache_shape``: ``K = MLA_KV_PACKING_SIZE`` tokens per
packed row, ``D'`` the latent and rope parts each padded to 128 lanes), sharded
``P("data", "kv_context")`` (``runner/kv_cache.py``): not split over the ``model`` axis, so every
device of that axis holds a replica of the whole latent. Each replica is one TP rank's buffer of
tpu_sync's ``rpamla`` layout (``[num_blocks, block_size, D']``, the same bytes): a pull writes every
replica, a register reads them (all equal).

Data parallelism: with the ``data`` axis on the blocks (``P("data", None, "model")``, DP > 1),
each DP replica's shards hold ``num_blocks`` blocks of their own, and the methods take global
block ids as tpu-inference's scheduler gives them (replica ``d`` holds ``d * num_blocks ..``;
one request's blocks are in one replica). The shard of DP replica ``d`` and TP rank ``t`` is
tpu_sync rank ``d * tp + t`` of a layout with ``dp = DP``, and a request's placement names its
replica (``dp_rank``), so the planner reshards between DP and non-DP layouts. With
``framework-copy`` a commit's update is put on the devices of every replica (its rows are not
split over the data axis; each replica's scatter keeps the rows of its own shard), so the H2D
moves DP times the blocks' bytes (``h2d_bytes`` counts them once).

Not mapped (refused with the reason): a data axis on another dimension than the blocks, an MLA
cache split over the ``kv_context`` axis (PCP/DCP in the mesh). Tiled physical layouts (a TPU's
``Layout.tiling``) matter only with ``pjrt-view``, where tpu_sync reads the shards themselves:
the layout is passed on in :meth:`JaxKv.layout`, and tpu_sync maps a tiling that keeps each
packed row contiguous (e.g. ``{4,3,2,1,0:T(4,128)(4,1)}``) for plans of whole packed rows
between two sides of that layout, refusing any other by name (``docs/tpu.md``);
``framework-copy`` moves JAX's dense host copies. (KV heads fewer than TP are mapped:
tpu-inference pads them to TP by repeating each head, ``repeat_interleave``, so each shard holds
one head, as tpu_sync's replicated TP split expects.)

With ``pjrt-view`` a pull writes the shards' memory behind JAX's back: an array whose host
value was already read (``np.asarray(array)``, ``jax.device_get``) keeps returning that cached
copy; read the runner's arrays after a forward (new arrays), as an engine does.

Thread-safety: one :class:`JaxKv` per model-runner thread; its calls must not overlap a forward
that donates the caches (the connector hooks run between forwards).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import _check as ck
from .arrays import ITEMSIZE
from .errors import InvalidArgumentError, MismatchError, UnsupportedError
from ._native import lib

NULL_BLOCK_ID = ck.NULL_BLOCK_ID

log = logging.getLogger("tpu_sync.jax")

#: JAX dtype name -> (tpu_sync buffer dtype, tpu_sync model dtype).
JAX_DTYPES = {
    "bfloat16": ("bf16", "bf16"),
    "float32": ("f32", "f32"),
    "float16": ("f16", "f16"),
    "float8_e4m3fn": ("f8e4m3fn", "fp8"),
}

BACKENDS = ("auto", "pjrt-view", "framework-copy")



def _uint(itemsize: int) -> Any:
    """The numpy unsigned integer type of ``itemsize`` bytes: KV moves as bit patterns."""
    import numpy as np

    return {1: np.uint8, 2: np.uint16, 4: np.uint32}[itemsize]


def _fail(cls: type, msg: str) -> Exception:
    status = {InvalidArgumentError: lib.TPU_SYNC_INVALID_ARGUMENT, MismatchError: lib.TPU_SYNC_MISMATCH,
              UnsupportedError: lib.TPU_SYNC_UNSUPPORTED}[cls]
    return cls(status, msg)


def xla_layout(fmt_layout: Any, rank: int) -> str:
    """A JAX ``Layout`` (``major_to_minor``, ``tiling``) in XLA's text form, as tpu_sync's
    ``physical_layout`` takes it: ``{minor_to_major:T(tile)(tile)}``, e.g. ``{4,3,2,1,0}`` (no
    tiling) or ``{4,3,2,1,0:T(4,128)(4,1)}``."""
    m2m = list(getattr(fmt_layout, "major_to_minor", None) or range(rank))[::-1]
    s = ",".join(str(int(d)) for d in m2m)
    tiles = getattr(fmt_layout, "tiling", None) or ()
    if tiles:
        s += ":T" + "".join("(" + ",".join(str(int(x)) for x in t) + ")" for t in tiles)
    return "{" + s + "}"


def _axis_of(spec: Sequence[Any], name: str) -> Optional[int]:
    """The array dimension sharded over mesh axis ``name`` (None: not sharded over it)."""
    for d, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if name in names:
            return d
    return None


class JaxKv:
    """A model runner's per-layer KV caches (``list[jax.Array]``), read lazily.

    Args:
        source: the runner (its ``kv_caches`` attribute is read on every use) or a callable
            returning the list; ``set_layer`` writes back through ``runner.kv_caches[l] = ...``
            (a callable source needs ``setter``).
        backend: ``"auto"`` (``pjrt-view`` where every shard is in host memory, else
            ``framework-copy``), or one of them.
        model_axis, data_axis: the mesh axis names of TP and DP (tpu-inference's defaults).
        client: the tpu_sync client that views and stages the bytes (default: a new one on the
            XLA CPU plugin).
        setter: ``setter(layer, array)`` for a callable source.
        block_size: the engine's tokens per block, when known: an MLA cache whose packed token
            rows hold another count (a block size that is not a multiple of ``K``) is refused.
        layer_arrays: for each cache layer, the index of its array in the runner's list
            (tpu-inference's ``runner.layer_name_to_kvcache_index`` in cache-layer order: with
            KV cache groups the layers at one position of every group may share one array);
            None: array ``l`` is cache layer ``l``.
        layer_group: the KV cache group of each cache layer (``0..G-1``; sliding window and
            full attention, each with its own block ids); None: one group. With several groups
            the copy methods take one list of block ids per group (as
            :class:`tpu_sync.torch_kv.TorchKv`), each layer copied at its own group's blocks.

    Raises:
        InvalidArgumentError: no caches, arrays of different shapes, dtypes or shardings, an
            unknown back end; UnsupportedError: a layout this module does not map (see the
            module's docs); ImportError without jax.
    """

    def __init__(self, source: Any, *, backend: str = "auto", model_axis: str = "model",
                 data_axis: str = "data", client: Any = None,
                 setter: Optional[Callable[[int, Any], None]] = None, block_size: Optional[int] = None,
                 layer_arrays: Optional[Sequence[int]] = None, layer_group: Optional[Sequence[int]] = None) -> None:
        import jax  # noqa: F401  (needed by every method; fail early without it)

        if backend not in BACKENDS:
            raise _fail(InvalidArgumentError, f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        self._source = source
        self._setter = setter
        self.model_axis, self.data_axis = model_axis, data_axis
        if client is None:
            import tpu_sync

            client = tpu_sync.Client()
        self.client = client
        caches = self.arrays()
        if layer_arrays is not None:
            layer_arrays = [int(i) for i in layer_arrays]
            bad = [i for i in layer_arrays if not 0 <= i < len(caches)]
            if not layer_arrays or bad:
                raise _fail(InvalidArgumentError, f"layer arrays {layer_arrays} for a runner of {len(caches)} arrays")
        #: index in the runner's list of each cache layer's array
        self._index: List[int] = list(range(len(caches))) if layer_arrays is None else layer_arrays
        if layer_group is not None:
            layer_group = [int(g) for g in layer_group]
            if (len(layer_group) != len(self._index)
                    or sorted(set(layer_group)) != list(range(max(layer_group) + 1))):
                raise _fail(InvalidArgumentError, f"layer groups {layer_group} for {len(self._index)} cache layers: "
                            "one group index per layer, the groups numbered 0..G-1 without a gap")
        #: KV cache group of each cache layer (None: one group)
        self.layer_group = layer_group
        self.num_groups = 1 if layer_group is None else max(layer_group) + 1
        # The arrays of the cache layers named (a hybrid model's runner also holds its state
        # layers' tuples, which tpu_sync.jax_state reads).
        used = sorted(set(self._index))
        a0 = caches[used[0]]
        for i in used:
            a = caches[i]
            if not hasattr(a, "addressable_shards"):
                raise _fail(InvalidArgumentError, f"runner.kv_caches[{i}] is {type(a).__name__}, not a jax.Array (a "
                            "state layer's tuple? name the attention layers' arrays: layer_arrays)")
            if a.shape != a0.shape or a.dtype != a0.dtype or a.sharding != a0.sharding:
                raise _fail(InvalidArgumentError, f"array {i}: shape {a.shape} {a.dtype} {a.sharding} differs from array "
                            f"{used[0]}'s {a0.shape} {a0.dtype} {a0.sharding}")
        if len(a0.shape) not in (4, 5):
            raise _fail(InvalidArgumentError, f"a KV cache of shape {a0.shape}: expected the RPA v3 cache "
                        "[num_blocks, block_size, R, P, D'] or tpu-inference's MLA cache [num_blocks, "
                        "block_size / K, K, D']")
        #: tpu-inference's MLA latent cache (4-dimensional), replicated over the model axis
        self.mla = len(a0.shape) == 4
        dt = str(a0.dtype)
        if dt not in JAX_DTYPES:
            raise _fail(UnsupportedError, f"KV cache dtype {dt} (supported: {', '.join(JAX_DTYPES)})")
        self.buffer_dtype, self.model_dtype = JAX_DTYPES[dt]
        self.num_layers = len(self._index)
        if self.mla and self.num_groups > 1:
            raise _fail(UnsupportedError, "KV cache groups of MLA caches: not mapped yet")
        self.sharding = a0.sharding
        spec = tuple(getattr(self.sharding, "spec", ()) or ())
        mesh = getattr(self.sharding, "mesh", None)
        sizes = dict(mesh.shape) if mesh is not None else {}
        data_dim = _axis_of(spec, data_axis)
        #: data-parallel shards of the block ids (tpu-inference's ``data`` axis on dimension 0,
        #: alone or grouped with other axes there, e.g. attention DP's ``("data", "attn_dp")``:
        #: the product of their sizes): DP replica ``d`` holds global blocks ``d * num_blocks ..
        #: (d + 1) * num_blocks - 1``
        self.dp = 1
        if data_dim is not None:
            entry = spec[data_dim]
            for name in (entry if isinstance(entry, tuple) else (entry,)):
                self.dp *= int(sizes.get(name, 1))
        if self.dp > 1 and data_dim != 0:
            raise _fail(UnsupportedError, f"the KV caches are split over mesh axis {data_axis!r} on dimension "
                        f"{data_dim}: only a split of the blocks (dimension 0) is mapped")
        self._mesh = mesh
        dim = _axis_of(spec, model_axis)
        shards = list(a0.addressable_shards)
        self.shard_shape = tuple(int(x) for x in shards[0].data.shape)
        #: device -> tpu_sync rank of its shard: ``dp_rank * tp + tp_rank``
        self._rank_of: Dict[Any, int] = {}
        if self.mla:
            if dim is not None:
                raise _fail(UnsupportedError, f"an MLA cache sharded over {model_axis!r} on dimension {dim}; "
                            "tpu-inference replicates it over that axis")
            if (tuple(self.shard_shape[1:]) != tuple(int(x) for x in a0.shape[1:])
                    or self.shard_shape[0] * self.dp != int(a0.shape[0])):
                raise _fail(UnsupportedError, f"an MLA cache split into shards of {self.shard_shape} (global "
                            f"{tuple(a0.shape)}): a kv_context (PCP/DCP) split is not mapped yet")
            # One replica per device of the model axis: TP rank = the device's position on it.
            import numpy as np

            self.tp = sizes.get(model_axis, 1) if mesh is not None else 1
            names = list(getattr(mesh, "axis_names", ()))
            for s in shards:
                r = 0
                if mesh is not None and model_axis in names:
                    at = np.argwhere(np.asarray(mesh.devices) == s.device)
                    r = int(at[0][names.index(model_axis)]) if len(at) else -1
                d = (s.index[0].start or 0) // self.shard_shape[0] if self.dp > 1 else 0
                if r < 0 or d * self.tp + r in self._rank_of.values():
                    where = f"position {r} on the {model_axis!r} axis is taken" if r >= 0 else "not in the mesh"
                    raise _fail(UnsupportedError, f"MLA replica on {s.device}: {where} (another mesh axis in play): "
                                "not mapped yet")
                self._rank_of[s.device] = d * self.tp + r
        else:
            if dim not in (None, 2):
                raise _fail(UnsupportedError, f"the KV caches are sharded over {model_axis!r} on dimension {dim}; "
                            "tpu-inference's RPA v3 cache shards dimension 2 (the packed head rows)")
            self.tp = sizes.get(model_axis, 1) if dim == 2 else 1
            # TP rank of each shard: its row range's start / rows per shard.
            rows = self.shard_shape[2]
            for s in shards:
                start = (s.index[2].start or 0) if dim == 2 else 0
                r = start // rows
                d = (s.index[0].start or 0) // self.shard_shape[0] if self.dp > 1 else 0
                if d * self.tp + r in self._rank_of.values():
                    raise _fail(UnsupportedError, f"TP rank {r}'s KV shard is on more than one device "
                                "(a data axis not in the sharding): not mapped yet")
                self._rank_of[s.device] = d * self.tp + r
        if self.shard_shape[0] * self.dp != int(a0.shape[0]):
            raise _fail(UnsupportedError, f"shards of {self.shard_shape[0]} blocks of {int(a0.shape[0])} for "
                        f"{self.dp} data-parallel replicas: a split of the blocks over other mesh axes is not "
                        "mapped")
        #: tpu_sync ranks held here (``dp_rank * tp + tp_rank``; the TP ranks when DP is 1)
        self.ranks: List[int] = sorted(self._rank_of.values())
        #: blocks per shard (per DP replica); with DP the methods take global block ids
        self.num_blocks = self.shard_shape[0]
        # tpu_sync's shape of a rank's buffer (the same bytes): the shard's own, or for MLA the
        # token-major [num_blocks, block_size, D'] of the rpamla layout.
        if self.mla:
            self.block_size = self.shard_shape[1] * self.shard_shape[2]
            if block_size is not None and int(block_size) != self.block_size:
                # [N, align(BS, K) / K, K, D']: a block size that is not a multiple of K leaves
                # padded token slots in every block, which the rpamla layout does not map.
                raise _fail(UnsupportedError, f"an MLA cache of {self.shard_shape[1]} x {self.shard_shape[2]} token "
                            f"slots per block for {block_size}-token blocks: the block size must be a multiple "
                            f"of {self.shard_shape[2]} (MLA_KV_PACKING_SIZE)")
            self.view_shape: Tuple[int, ...] = (self.num_blocks, self.block_size, self.shard_shape[3])
        else:
            self.block_size = self.shard_shape[1]
            self.view_shape = self.shard_shape
        self.physical_layout = xla_layout(getattr(getattr(shards[0].data, "format", None), "layout", None),
                                          len(self.shard_shape))
        host = all(getattr(s.device, "platform", "") == "cpu" for s in shards)
        if backend == "auto":
            backend = "pjrt-view" if host else "framework-copy"
            why = ("the shards are in host memory (JAX CPU devices): viewed in place" if host else
                   f"the shards are on {shards[0].device.platform} devices, whose memory tpu_sync's client "
                   "cannot address: JAX's own copies")
        else:
            why = "chosen by the caller"
        if backend == "pjrt-view" and not host:
            raise _fail(UnsupportedError, f"backend pjrt-view needs the shards in host memory; they are on "
                        f"{shards[0].device.platform} devices (use framework-copy)")
        self.backend, self.backend_reason = backend, why
        self._views: Optional[Tuple[Tuple[int, ...], Dict[int, List[Any]]]] = None
        self._scatter: Any = None
        self._mirrors: Optional[Tuple[Dict[int, List[Any]], Dict[int, List[Any]]]] = None
        self._counters = dict(views_built=0, d2h_bytes=0, h2d_bytes=0, registers=0, pulls=0)
        log.info("tpu_sync.jax: %d layers, TP=%d, shards %s %s, layout %s; back end %s (%s)", self.num_layers,
                 self.tp, self.shard_shape, dt, self.physical_layout, backend, why)

    # -- the caches ---------------------------------------------------------------------------

    def arrays(self) -> List[Any]:
        """The runner's current per-layer arrays (read again on every call)."""
        return runner_caches(self._source)

    def layer_arrays(self) -> List[Any]:
        """The current array of each cache layer (the same array for layers that share one)."""
        a = self.arrays()
        return [a[i] for i in self._index]

    def set_layer(self, layer: int, array: Any) -> None:
        """Replaces cache layer ``layer``'s array in the runner (after a scatter; the entry of
        its array in the runner's list, which layers sharing it see too)."""
        self._set_array(self._index[layer], array)

    def _set_array(self, index: int, array: Any) -> None:
        set_runner_cache(self._source, self._setter, index, array)

    def stats(self) -> Dict[str, Any]:
        """Back end and reason, shard geometry, and counters (views built, bytes copied by JAX's
        own copies, registers, pulls)."""
        return dict(self._counters, backend=self.backend, backend_reason=self.backend_reason, tp=self.tp, dp=self.dp,
                    ranks=list(self.ranks), shard_shape=list(self.shard_shape), physical_layout=self.physical_layout,
                    mla=self.mla)

    def layout(self, model: Dict[str, Any], num_blocks: Optional[int] = None) -> Dict[str, Any]:
        """tpu_sync's layout of these caches for ``model`` (RPA v3, or its head_dim-64 form
        ``rpa3hd64`` when ``model["head_dim"]`` is 64, or ``rpamla`` for an MLA cache; TP from the
        mesh, the shards' block size and physical layout); ``num_blocks`` defaults to the
        caches'."""
        import tpu_sync

        # tpu-inference runs the head_dim-64 kernel (K and V of a head side by side in one
        # 128-lane row) whenever head_dim is 64 (ragged_paged_attention/v3/kernel_hd64.py).
        order = "rpamla" if self.mla else "rpa3hd64" if int(model.get("head_dim", 0)) == 64 else "rpa3"
        lay = tpu_sync.layout(model, tp=self.tp, dp=self.dp, block_size=self.block_size, order=order,
                              num_blocks=self.num_blocks if num_blocks is None else num_blocks)
        if self.backend == "pjrt-view" and self.physical_layout != xla_layout(None, len(self.shard_shape)):
            # tpu_sync reads the shards themselves: their tiling decides which plans are exact
            # (whole packed rows only). With framework-copy it moves JAX's dense host copies.
            lay["physical_layout"] = self.physical_layout
        return lay

    def _shards(self) -> Dict[int, List[Any]]:
        """TP rank -> that rank's shard array of every layer (current arrays)."""
        out: Dict[int, List[Any]] = {r: [] for r in self.ranks}
        for i, a in enumerate(self.layer_arrays()):
            for s in a.addressable_shards:
                r = self._rank_of.get(s.device)
                if r is None or tuple(s.data.shape) != self.shard_shape:
                    raise _fail(MismatchError, f"layer {i}: the runner's cache changed its sharding or shape "
                                f"(shard on {s.device}: {tuple(s.data.shape)}, expected {self.shard_shape})")
                out[r].append(s.data)
        return out

    def views(self) -> Dict[int, List[Any]]:
        """``pjrt-view``: TP rank -> per-layer zero-copy buffers over the shards' memory, built
        again when a forward moved any shard (the pointers are compared on every call)."""
        if self.backend != "pjrt-view":
            raise _fail(UnsupportedError, f"views need the pjrt-view back end (this is {self.backend})")
        import numpy as np

        shards = self._shards()
        ptrs = tuple(int(d.unsafe_buffer_pointer()) for r in self.ranks for d in shards[r])
        if self._views is not None and self._views[0] == ptrs:
            return self._views[1]
        nbytes = int(np.prod(self.shard_shape)) * shards[self.ranks[0]][0].dtype.itemsize
        views: Dict[int, List[Any]] = {}
        for r in self.ranks:
            per = []
            for d in shards[r]:
                raw = (ctypes.c_uint8 * nbytes).from_address(int(d.unsafe_buffer_pointer()))
                host = np.frombuffer(raw, dtype=np.uint8)
                # The view keeps the shard alive (its keepalive), and the shard its memory.
                host_keep = _Keep(host, d)
                per.append(self.client.view(host_keep.array, shape=self.view_shape, dtype=self.buffer_dtype))
                per[-1]._jax_keep = host_keep
            views[r] = per
        if self._views is not None:
            close_buffers(self._views[1])
        self._views = (ptrs, views)
        self._counters["views_built"] += 1
        return views

    # -- framework copies ---------------------------------------------------------------------

    def _ids(self, block_ids: Sequence[int]) -> Any:
        import numpy as np

        ids = np.asarray([ck.u32("block id", b) for b in block_ids], dtype=np.int32)
        total = self.num_blocks * self.dp
        if ids.size and int(ids.max()) >= total:
            raise _fail(InvalidArgumentError, f"block id {int(ids.max())} out of range 0..{total}")
        return ids

    def replica_ranks(self, dp_rank: int) -> List[int]:
        """The ranks of DP replica ``dp_rank`` held here (its TP ranks, ``dp_rank * tp + t``)."""
        return [r for r in self.ranks if r // self.tp == dp_rank]

    def split(self, block_ids: Sequence[int]) -> Tuple[int, List[int]]:
        """``(dp_rank, local ids)`` of global block ids (with DP, replica ``d`` holds global
        blocks ``d * num_blocks ..``; a request's blocks are on one replica). DP 1: ``(0, ids)``.

        Raises:
            InvalidArgumentError: ids out of range, or ids of several DP replicas."""
        ids = [int(b) for b in self._ids(block_ids)]
        if self.dp == 1:
            return 0, ids
        reps = sorted({b // self.num_blocks for b in ids})
        if len(reps) > 1:
            raise _fail(InvalidArgumentError, f"block ids {ids} lie in DP replicas {reps}: a request's blocks are in "
                        "one replica's shard")
        d = reps[0] if reps else 0
        return d, [b - d * self.num_blocks for b in ids]

    def _per_layer(self, block_ids: Any) -> List[List[int]]:
        """Each cache layer's block ids: a flat list is every layer's; one list per KV cache
        group (``[[...], ...]``, as many as :attr:`num_groups`) gives each layer its group's
        (vLLM's null block, id 0, skipped).

        Raises:
            InvalidArgumentError: per-group lists for another number of groups, ids out of range."""
        ids = list(block_ids)
        if ck.per_group(ids):
            if len(ids) != self.num_groups:
                raise _fail(InvalidArgumentError, f"block ids for {len(ids)} KV cache groups; the layers are in "
                            f"{self.num_groups}")
            groups = self.layer_group or [0] * self.num_layers
            per = [[int(b) for b in ids[groups[layer]] if int(b) != NULL_BLOCK_ID] for layer in range(self.num_layers)]
        elif self.num_groups > 1 and ids:
            raise _fail(InvalidArgumentError, f"a flat list of block ids for layers in {self.num_groups} KV cache "
                        "groups: give one list per group")
        else:
            per = [[int(b) for b in ids]] * self.num_layers
        for layer_ids in per:
            self._ids(layer_ids)
        return per

    @staticmethod
    def _flat(block_ids: Any) -> List[int]:
        """Every block id of a flat list or of per-group lists (null blocks of groups skipped)."""
        return ck.flat_block_ids(block_ids)

    def gather(self, block_ids: Sequence[int]) -> Dict[int, List[Any]]:
        """``framework-copy`` D2H: the blocks ``block_ids`` of every layer, copied by JAX into
        compact host arrays ``[len(block_ids), block_size, R, P, D']`` (an MLA cache:
        ``[len(block_ids), block_size / K, K, D']``) of their bit patterns (unsigned integers),
        per rank of the DP replica holding them: ``{rank: [array per layer]}``. An MLA cache's
        replicas hold the same bytes: one is copied and every rank maps to it."""
        d, local = self.split(block_ids)
        return self._gather([local] * self.num_layers, d)

    def _gather(self, per_layer: List[List[int]], dp_rank: int = 0) -> Dict[int, List[Any]]:
        """:meth:`gather` with each layer's own (local) block ids of DP replica ``dp_rank``."""
        import jax
        import numpy as np

        shards = self._shards()
        out: Dict[int, List[Any]] = {}
        replica = self.replica_ranks(dp_rank)
        for r in replica:
            if self.mla and out:
                out[r] = out[replica[0]]  # a replica of the same latent: copied once
                continue
            per = []
            for d, layer_ids in zip(shards[r], per_layer):
                ids = np.asarray(layer_ids, dtype=np.int32)
                # The gather on the bit patterns too (see scatter).
                bits = jax.lax.bitcast_convert_type(d, _uint(d.dtype.itemsize))
                if ids.size:
                    host = np.asarray(jax.device_get(bits[ids]))
                    self._counters["d2h_bytes"] += host.nbytes
                else:
                    host = np.zeros((0,) + tuple(d.shape[1:]), dtype=_uint(d.dtype.itemsize))
                per.append(host)
            out[r] = per
        return out

    def scatter(self, block_ids: Sequence[int], data: Dict[int, List[Any]]) -> None:
        """``framework-copy`` H2D: writes ``data[rank][layer]`` (as :meth:`gather` returns) into
        blocks ``block_ids`` of every rank's shard (an MLA cache: of its one replicated array,
        after checking every rank's data is the same), by a jitted scatter that donates the old
        cache; the result replaces the layer's array in ``runner.kv_caches``.

        Raises:
            InvalidArgumentError: layers in several KV cache groups (their blocks differ: use
                :meth:`commit` with one list per group), ids out of range, data for other ranks;
            MismatchError: an update of another shape, MLA replicas that differ."""
        if self.num_groups > 1:
            raise _fail(InvalidArgumentError, f"scatter of one list of block ids into layers of {self.num_groups} KV "
                        "cache groups: commit one list per group")
        d, _ = self.split(block_ids)
        self._scatter_layers([[int(b) for b in self._ids(block_ids)]] * self.num_layers, data, d)

    def _scatter_layers(self, per_layer: List[List[int]], data: Dict[int, List[Any]], dp_rank: int = 0) -> None:
        """:meth:`scatter` with each layer's own block ids. Layers that share one array (KV
        cache groups) are written by one scatter of their ids together.

        Raises:
            InvalidArgumentError: data for other ranks, a block written twice into one array;
            MismatchError: an update of another shape, MLA replicas that differ."""
        import jax
        import numpy as np

        replica = self.replica_ranks(dp_rank)
        if sorted(data) != replica:
            raise _fail(InvalidArgumentError, f"data for ranks {sorted(data)}, DP replica {dp_rank} of the caches has "
                        f"ranks {replica}")
        if self._scatter is None:
            from jax import lax

            def scatter(c: Any, i: Any, u: Any) -> Any:
                # On the bit patterns: a floating-point scatter may canonicalise NaN payloads
                # (XLA's CPU backend does, in the whole array), and KV bytes must move unchanged.
                bits = lax.bitcast_convert_type(c, u.dtype).at[i].set(u)
                return lax.bitcast_convert_type(bits, c.dtype)

            self._scatter = jax.jit(scatter, donate_argnums=0)
        arrays = self.arrays()
        layers_of: Dict[int, List[int]] = {}
        for layer, index in enumerate(self._index):
            if per_layer[layer]:
                layers_of.setdefault(index, []).append(layer)
        for index, layers in layers_of.items():
            a = arrays[index]
            ids = np.asarray([b for layer in layers for b in per_layer[layer]], dtype=np.int32)
            if len(set(ids.tolist())) != ids.size:
                raise _fail(InvalidArgumentError, f"cache layers {layers} share one array and would write a block "
                            "twice (their block ids overlap)")
            want = (len(ids),) + self.shard_shape[1:]
            u = _uint(np.dtype(a.dtype).itemsize)
            parts = []
            for r in replica:
                for layer in layers:
                    p = data[r][layer]
                    if tuple(p.shape) != (len(per_layer[layer]),) + self.shard_shape[1:]:
                        raise _fail(MismatchError, f"rank {r} layer {layer}: update of shape "
                                    f"{tuple(p.shape)}, expected "
                                    f"{(len(per_layer[layer]),) + self.shard_shape[1:]}")
                parts.append(np.concatenate([np.asarray(data[r][layer]).view(u) for layer in layers], axis=0)
                             if len(layers) > 1 else np.asarray(data[r][layers[0]]).view(u))
            # The update's rows are not split over a data axis (the ids are global blocks of one
            # replica): each device gets them all, and the scatter writes those in its shard.
            sharding = self.sharding if self.dp == 1 else self._update_sharding()
            if self.mla:
                # One latent, replicated: every replica must have received the same bytes.
                for r, p in zip(replica, parts):
                    if not np.array_equal(p, parts[0]):
                        raise _fail(MismatchError, f"layer {layers[0]}: MLA replica of TP rank {r} differs from "
                                    f"TP rank {replica[0]}'s (a replicated cache must stay identical)")
                upd = jax.make_array_from_callback(want, sharding, lambda idx: parts[0][idx])
            else:
                glob = want[:2] + (want[2] * self.tp,) + want[3:]
                upd = jax.make_array_from_callback(
                    glob, sharding, lambda idx: parts[(idx[2].start or 0) // want[2]])
            self._set_array(index, self._scatter(a, ids, upd))
            self._counters["h2d_bytes"] += sum(p.nbytes for p in parts)

    def _update_sharding(self) -> Any:
        """The sharding of a scatter's update with DP: the caches' own without the data axis
        (rows replicated over it)."""
        from jax.sharding import NamedSharding, PartitionSpec

        spec = list(getattr(self.sharding, "spec", ()) or ())
        spec += [None] * (len(self.shard_shape) - len(spec))
        spec[0] = None
        return NamedSharding(self._mesh, PartitionSpec(*spec))

    # -- block-level access for the engine connectors -------------------------------------------

    def rank_views(self) -> Dict[int, List[Any]]:
        """TP rank -> per-layer PJRT buffers tpu_sync copies blocks in and out of, in the block
        geometry of the caches (same block ids): the shards themselves (``pjrt-view``, rebuilt
        when a forward moved them), or host mirrors of the shards (``framework-copy``: anonymous
        memory the size of a shard, committed only where :meth:`stage` or a transfer wrote, and
        given back by :meth:`drop`). With ``framework-copy``, :meth:`stage` the blocks before
        tpu_sync reads them, and :meth:`commit` them after tpu_sync wrote them."""
        if self.backend == "pjrt-view":
            return self.views()
        if self._mirrors is None:
            import mmap

            import numpy as np

            nbytes = int(np.prod(self.shard_shape)) * ITEMSIZE[self.buffer_dtype]
            maps, views = {}, {}
            for r in self.ranks:
                maps[r], views[r] = [], []
                for _ in range(self.num_layers):
                    # Page-aligned, zero until written; MAP_PRIVATE | MAP_ANONYMOUS.
                    m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                    arr = np.frombuffer(m, dtype=np.uint8)
                    maps[r].append(m)
                    views[r].append(self.client.view(arr, shape=self.view_shape, dtype=self.buffer_dtype))
            self._mirrors = (maps, views)
        return self._mirrors[1]

    def _mirror_arrays(self) -> Dict[int, List[Any]]:
        import numpy as np

        assert self._mirrors is not None
        np_t = _uint(ITEMSIZE[self.buffer_dtype])
        return {r: [np.frombuffer(m, dtype=np_t).reshape(self.shard_shape) for m in ms]
                for r, ms in self._mirrors[0].items()}

    def replica_views(self, dp_rank: int) -> Dict[int, List[Any]]:
        """:meth:`rank_views` of DP replica ``dp_rank``'s ranks (``{dp_rank * tp + t: [buffer
        per layer]}``), the buffers of a placement in that replica."""
        return self._replica_views(dp_rank)

    def _replica_views(self, dp_rank: int) -> Dict[int, List[Any]]:
        """:meth:`rank_views` of DP replica ``dp_rank``'s ranks."""
        keep = set(self.replica_ranks(dp_rank))
        return {r: v for r, v in self.rank_views().items() if r in keep}

    def pointers(self) -> Tuple[int, ...]:
        """The shards' current addresses (``pjrt-view``): compared before and after a transfer
        into them, so one that a forward moved mid-transfer is caught."""
        if self.backend != "pjrt-view":
            return ()
        shards = self._shards()
        return tuple(int(d.unsafe_buffer_pointer()) for r in self.ranks for d in shards[r])

    def stage(self, block_ids: Any) -> None:
        """``framework-copy``: copies blocks ``block_ids`` of every layer and rank into the host
        mirrors (JAX's gather and D2H) before tpu_sync reads them; nothing for ``pjrt-view``.
        ``block_ids``: a flat list, or one list per KV cache group (``layer_group``), each
        layer copied at its own group's blocks."""
        if self.backend == "pjrt-view" or not len(block_ids):
            return
        self.rank_views()
        per = self._per_layer(block_ids)
        d, _ = self.split(self._flat(block_ids))
        local = [[b - d * self.num_blocks for b in ids] for ids in per]
        got = self._gather(local, d)
        mirrors = self._mirror_arrays()
        for r in self.replica_ranks(d):
            for layer, g in enumerate(got[r]):
                if len(local[layer]):
                    mirrors[r][layer][local[layer]] = g

    def commit(self, block_ids: Any) -> None:
        """``framework-copy``: writes blocks ``block_ids`` (as :meth:`stage`) of the host mirrors
        into the caches (JAX's H2D and a donating scatter; ``runner.kv_caches`` replaced) after
        tpu_sync wrote them; nothing for ``pjrt-view`` (tpu_sync wrote the shards in place)."""
        if self.backend == "pjrt-view" or not len(block_ids):
            return
        self.rank_views()
        per = self._per_layer(block_ids)
        d, _ = self.split(self._flat(block_ids))
        local = [[b - d * self.num_blocks for b in ids] for ids in per]
        mirrors = self._mirror_arrays()
        self._scatter_layers(per, {r: [m[ids] for m, ids in zip(mirrors[r], local)] for r in self.replica_ranks(d)},
                             d)

    def hold(self, block_ids: Any) -> None:
        """Nothing to do: :meth:`drop` gives back only the pages of the blocks it names (as
        :meth:`tpu_sync.torch_kv.TorchKv.hold`'s callers expect)."""

    def drop(self, block_ids: Any) -> None:
        """``framework-copy``: gives the host memory of blocks ``block_ids``' mirror pages back
        (``madvise(MADV_DONTNEED)``: they read as zero again), so the mirrors hold only blocks in
        flight. ``block_ids``: a flat list or one list per KV cache group. Nothing for
        ``pjrt-view``."""
        if self.backend == "pjrt-view" or self._mirrors is None or not len(block_ids):
            return
        import mmap

        import numpy as np

        block = int(np.prod(self.shard_shape[1:])) * ITEMSIZE[self.buffer_dtype]
        page = mmap.PAGESIZE
        flat = self._flat(block_ids)
        for r, ms in self._mirrors[0].items():
            for m in ms:
                for g in flat:
                    if g // self.num_blocks != r // self.tp:
                        continue  # another DP replica's block
                    b = g % self.num_blocks
                    # Whole pages inside the block only (a neighbour's bytes stay).
                    lo = -(-(int(b) * block) // page) * page
                    hi = ((int(b) + 1) * block // page) * page
                    if hi > lo:
                        m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def before_write(self, block_ids: Any, num_tokens: int, partial: Any = None) -> Tuple[int, ...]:
        """Before tpu_sync writes ``num_tokens`` tokens into blocks ``block_ids`` (a pull; flat
        or per KV cache group): ``framework-copy`` writes whole blocks back, so the blocks it
        writes in part go into the mirror first and their other token slots come back
        unchanged: ``partial`` (as ``block_ids``; e.g. a sliding-window group's first block),
        or by default a partial last block. Returns the shards' addresses for
        :meth:`after_write`."""
        if partial is not None:
            if self._flat(partial):
                self.stage(partial)
        elif block_ids and num_tokens % self.block_size:
            self.stage(ck.last_block_ids(block_ids))
        return self.pointers()

    def after_write(self, block_ids: Sequence[int], ptrs: Tuple[int, ...]) -> None:
        """After tpu_sync wrote blocks ``block_ids`` (a pull): checks the shards are still where
        it wrote (``pjrt-view``: ``ptrs`` from :meth:`before_write`), or commits the mirrors'
        blocks into the caches (``framework-copy``); the mirrors' pages are given back either way.

        Raises:
            RuntimeError: a forward moved the caches while they were written (the blocks are
                not valid); JAX's errors from the copies."""
        try:
            if self.pointers() != ptrs:
                raise RuntimeError("the runner's KV caches moved while a transfer wrote into them (a forward "
                                   "that did not donate them in place)")
            self.commit(block_ids)
        finally:
            self.drop(block_ids)

    def close(self) -> None:
        """Closes the views and the host mirrors (the runner's caches are untouched)."""
        if self._views is not None:
            close_buffers(self._views[1])
            self._views = None
        if self._mirrors is not None:
            close_buffers(self._mirrors[1])
            self._mirrors = None

    # -- P/D through a tpu_sync.Endpoint --------------------------------------------------------

    def register(self, endpoint: Any, request_id: int, model: Dict[str, Any], block_ids: Sequence[int],
                 num_tokens: int, expected_releases: int = 1) -> Dict[str, Any]:
        """Producer: registers request ``request_id`` held in blocks ``block_ids`` (the same on
        every TP rank: one block table for the SPMD program) on ``endpoint`` and returns the
        placement consumers pull from (:meth:`tpu_sync.Endpoint.pull`'s ``src_placement``).
        The blocks are staged when this returns (the next forward may overwrite them).

        Raises: as :meth:`tpu_sync.Endpoint.register`, and InvalidArgumentError for ids."""
        import tpu_sync

        ids = [ck.u32("block id", b) for b in block_ids]
        d, local = self.split(ids)
        place = tpu_sync.placement(self.layout(model), [local] * self.tp, dp_rank=d)
        self.stage(ids)
        try:
            endpoint.register(request_id, place, num_tokens, self._replica_views(d),
                              expected_releases=expected_releases)
        finally:
            self.drop(ids)  # staged by the endpoint (or failed)
        self._counters["registers"] += 1
        return place

    def pull(self, endpoint: Any, request_id: int, peers: Any, src_placement: Dict[str, Any],
             model: Dict[str, Any], block_ids: Sequence[int], num_tokens: int,
             timeout_s: float = 60.0, wait_for_registration: Optional[float] = None) -> Dict[str, Any]:
        """Consumer: pulls request ``request_id`` from ``peers`` into blocks ``block_ids`` (the
        same on every TP rank) of these caches, resharding from ``src_placement``; blocks until
        the bytes are in the caches and returns the transfer's report.

        Raises: as :meth:`tpu_sync.Endpoint.pull` and :meth:`tpu_sync.Transfer.wait`
        (``PendingError``, a TimeoutError, after ``timeout_s``: the pull is cancelled), and
        :meth:`after_write`'s errors."""
        import tpu_sync

        ids = [ck.u32("block id", b) for b in block_ids]
        d, local = self.split(ids)
        dst = tpu_sync.placement(self.layout(model), [local] * self.tp, dp_rank=d)
        ptrs = self.before_write(ids, num_tokens)
        try:
            t = endpoint.pull(request_id, peers, src_placement, dst, num_tokens, self._replica_views(d),
                              wait_for_registration=wait_for_registration)
            report = _wait(t, timeout_s)
        except BaseException:
            self.drop(ids)
            raise
        self.after_write(ids, ptrs)
        self._counters["pulls"] += 1
        return report


def runner_caches(source: Any) -> List[Any]:
    """The current ``kv_caches`` list of a runner (or what a callable ``source`` returns).

    Raises:
        InvalidArgumentError: none, or an empty list."""
    caches = source() if callable(source) and not hasattr(source, "kv_caches") else getattr(source, "kv_caches", None)
    if caches is None or len(caches) == 0:
        raise _fail(InvalidArgumentError, "the runner has no KV caches (runner.kv_caches is empty or unset)")
    return list(caches)


def set_runner_cache(source: Any, setter: Optional[Callable[[int, Any], None]], index: int, value: Any) -> None:
    """Replaces entry ``index`` of the runner's ``kv_caches`` (through ``setter`` where given)."""
    if setter is not None:
        setter(index, value)
    else:
        source.kv_caches[index] = value


def close_buffers(by_rank: Dict[int, List[Any]]) -> None:
    """Closes every buffer of ``{rank: [buffer per layer]}`` (views or mirrors)."""
    for bufs in by_rank.values():
        for b in bufs:
            b.close()


class _Keep:
    """A host view of a shard's memory and the shard that owns it (kept alive together)."""

    def __init__(self, array: Any, owner: Any) -> None:
        self.array, self.owner = array, owner


def _wait(t: Any, timeout_s: float) -> Dict[str, Any]:
    """Waits for transfer ``t``; cancels it (and raises ``PendingError``, a TimeoutError) after
    ``timeout_s``."""
    from .errors import PendingError

    try:
        return t.wait(timeout_s)
    except PendingError:
        t.cancel()
        raise
