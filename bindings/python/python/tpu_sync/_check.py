"""Argument checks of the public API (internal): every public function converts its arguments
with these before anything reaches cffi, so bad input raises
:class:`~tpu_sync.errors.InvalidArgumentError` (never a bare ``TypeError``, ``ValueError`` or
``OverflowError`` from a C conversion)."""

from __future__ import annotations

import json
import math
import operator
import os
from typing import Any, Callable, List, Optional, TypeVar

from ._native import lib
from .errors import InvalidArgumentError

T = TypeVar("T")

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
I64_MAX = (1 << 63) - 1
I64_MIN = -(1 << 63)
#: The native ``size_t`` range (64-bit platforms).
SIZE_MAX = U64_MAX


def fail(message: str) -> InvalidArgumentError:
    """The error to raise for a bad argument."""
    return InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, message)


def integer(name: str, v: Any, lo: int = 0, hi: int = U64_MAX) -> int:
    """``v`` as an int in ``lo..=hi``: ints and integer-like objects (numpy integers, anything
    with ``__index__``), not bools, floats or strings."""
    if isinstance(v, bool):
        raise fail(f"{name} must be an integer, got a bool ({v!r})")
    try:
        n = operator.index(v)
    except Exception:  # TypeError, or whatever a foreign __index__ raises
        raise fail(f"{name} must be an integer, got {type(v).__name__} {_short(v)}") from None
    if not lo <= n <= hi:
        raise fail(f"{name} = {n} is out of range {lo}..={hi}")
    return n


def u32(name: str, v: Any, lo: int = 0) -> int:
    """An unsigned 32-bit integer (``lo`` ..= 2^32 - 1)."""
    return integer(name, v, lo, U32_MAX)


def u64(name: str, v: Any, lo: int = 0) -> int:
    """An unsigned 64-bit integer."""
    return integer(name, v, lo, U64_MAX)


def usize(name: str, v: Any, lo: int = 0) -> int:
    """A ``size_t``."""
    return integer(name, v, lo, SIZE_MAX)


def i64(name: str, v: Any, lo: int = I64_MIN, hi: int = I64_MAX) -> int:
    """A signed 64-bit integer."""
    return integer(name, v, lo, hi)


def number(name: str, v: Any, lo: Optional[float] = None, positive: bool = False) -> float:
    """A finite real number (int or float, not bool), at least ``lo``; > 0 when ``positive``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
        raise fail(f"{name} must be a number, got {type(v).__name__} {_short(v)}")
    try:
        f = float(v)
    except Exception:  # TypeError, ValueError, OverflowError, or a foreign __float__'s error
        raise fail(f"{name} must be a number, got {_short(v)}") from None
    if not math.isfinite(f):
        raise fail(f"{name} must be finite, got {f}")
    if lo is not None and f < lo:
        raise fail(f"{name} must be >= {lo}, got {f}")
    if positive and f <= 0:
        raise fail(f"{name} must be > 0, got {f}")
    return f


def seconds_ms(name: str, v: Optional[Any]) -> int:
    """A timeout in seconds (None: no limit) as native milliseconds (-1: no limit)."""
    if v is None:
        return -1
    f = number(name, v, lo=0.0)
    return min(int(f * 1000), I64_MAX)


def flag(name: str, v: Any) -> bool:
    """A bool (``True``/``False``, or the ints 0 and 1)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise fail(f"{name} must be True or False, got {type(v).__name__} {_short(v)}")


def text(name: str, v: Any, allow_nul: bool = False) -> str:
    """A string (``str`` only); without NUL characters unless ``allow_nul``."""
    if not isinstance(v, str):
        raise fail(f"{name} must be a string, got {type(v).__name__} {_short(v)}")
    if not allow_nul and "\0" in v:
        raise fail(f"{name} must not contain NUL characters")
    return v


def cstr(name: str, v: Any) -> bytes:
    """A string as NUL-terminated UTF-8 for C."""
    s = text(name, v)
    try:
        return s.encode()
    except UnicodeEncodeError:
        raise fail(f"{name} is not valid UTF-8 (lone surrogates?)") from None


def path(name: str, v: Any) -> bytes:
    """A file system path (``str`` or ``os.PathLike`` of str) as C bytes."""
    if isinstance(v, os.PathLike):
        v = os.fspath(v)
    if isinstance(v, bytes):
        try:
            v = v.decode()
        except UnicodeDecodeError:
            raise fail(f"{name} is not UTF-8") from None
    return cstr(name, v)


def optional(check: Callable[..., T], name: str, v: Any, *a: Any, **kw: Any) -> Optional[T]:
    """``check(name, v)`` unless ``v`` is None."""
    return None if v is None else check(name, v, *a, **kw)


def items(name: str, v: Any) -> List[Any]:
    """A sequence (list, tuple, range, generator, ...; not a string, bytes or a mapping) as a
    list."""
    if isinstance(v, (str, bytes, bytearray, memoryview, dict)) or v is None:
        raise fail(f"{name} must be a sequence, got {type(v).__name__} {_short(v)}")
    try:
        return list(v)
    except Exception:  # not iterable, or an iterator that raises
        raise fail(f"{name} must be a sequence, got {type(v).__name__} {_short(v)}") from None


def json_text(name: str, v: Any) -> bytes:
    """A JSON argument: a JSON string, or a dict/list converted with ``json.dumps`` (NaN and
    non-JSON values refused)."""
    if isinstance(v, str):
        return cstr(name, v)
    if not isinstance(v, (dict, list)):
        raise fail(f"{name} must be a dict or a JSON string, got {type(v).__name__} {_short(v)}")
    try:
        return json.dumps(v, allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as e:
        raise fail(f"{name} is not JSON-serialisable: {e}") from None


def instance(name: str, v: Any, cls: type) -> Any:
    """``v`` if it is a ``cls``."""
    if not isinstance(v, cls):
        raise fail(f"{name} must be a {cls.__name__}, got {type(v).__name__} {_short(v)}")
    return v


def _short(v: Any) -> str:
    try:
        r = repr(v)
    except Exception:  # a repr that raises
        return "(unprintable)"
    return r if len(r) <= 60 else r[:57] + "..."


#: vLLM's null block (``BlockPool``'s block 0): in per-group block lists, a block a group does not
#: hold (e.g. outside a sliding window), never copied.
NULL_BLOCK_ID = 0


def per_group(block_ids: Any) -> bool:
    """Whether ``block_ids`` is one list per KV cache group (``[[...], ...]``) rather than flat."""
    ids = list(block_ids)
    return bool(ids) and isinstance(ids[0], (list, tuple))


def flat_block_ids(block_ids: Any) -> List[int]:
    """Every block id of a flat list, or of per-group lists with the null blocks left out."""
    if per_group(block_ids):
        return [int(b) for g in block_ids for b in g if int(b) != NULL_BLOCK_ID]
    return [int(b) for b in block_ids]


def last_block_ids(block_ids: Any) -> Any:
    """The last block of a flat list (``[b]``), or of each group's list with the null blocks
    left out (``[[b], ...]``): where a pull ends inside a block."""
    if per_group(block_ids):
        return [[b for b in g if int(b) != NULL_BLOCK_ID][-1:] for g in block_ids]
    return list(block_ids)[-1:]


def state_slot(part_bytes: List[int], slot_bytes: int, view_dtype: str, what: str) -> List[int]:
    """Where each part (a state component's bytes of one slot) starts in a slot of
    ``slot_bytes`` that holds the parts one after another (a state group's slot), after checking
    that they fit and that ``view_dtype`` (a tpu_sync buffer dtype) divides the slot.

    Raises:
        InvalidArgumentError: parts larger than the slot (``what`` names them), an unknown
            view dtype or one whose size does not divide ``slot_bytes``."""
    from .arrays import ITEMSIZE

    if sum(part_bytes) > slot_bytes:
        raise fail(f"{what} of {sum(part_bytes)} B per slot in slots of {slot_bytes} B")
    if view_dtype not in ITEMSIZE or slot_bytes % ITEMSIZE[view_dtype]:
        raise fail(f"view dtype {view_dtype!r} for slots of {slot_bytes} B")
    return [sum(part_bytes[:j]) for j in range(len(part_bytes))]
