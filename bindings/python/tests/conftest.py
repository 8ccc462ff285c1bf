import os
import sys

import pytest

# The tests run against the installed package (a wheel built by `make python`), never the source
# tree, so that what users install is what is tested.
here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p) != os.path.join(os.path.dirname(here), "python")]


def pattern(n: int, seed: int = 1) -> bytes:
    """Non-zero, non-repeating test bytes."""
    out = bytearray(n)
    x = (seed * 0x9E3779B97F4A7C15) & (2**64 - 1)
    for i in range(n):
        x ^= (x << 13) & (2**64 - 1)
        x ^= x >> 7
        x ^= (x << 17) & (2**64 - 1)
        out[i] = (x & 0xFF) | 1
    return bytes(out)


@pytest.fixture
def data():
    return pattern
