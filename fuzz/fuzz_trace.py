"""Fuzz the routing-trace reader (``expert_trace.bin``: little-endian int32 pairs).

Input: one control byte choosing the bounds, then the trace's bytes. Accepted traces are
``(N, 2)`` int32 arrays inside the bounds.
"""

from __future__ import annotations

import numpy as np
from fuzz_common import instrumented, main

with instrumented(__name__):
    from k3core.api.errors import K3Error
    from k3core.experts.trace import parse_trace_bytes

BOUNDS = [(None, None), (92, 896), (4, 8), (0, 1)]


def one_input(data: bytes) -> None:
    if not data:
        return
    n_layers, n_experts = BOUNDS[data[0] % len(BOUNDS)]
    try:
        pairs = parse_trace_bytes(data[1:], n_layers, n_experts)
    except K3Error as exc:
        assert exc.message and exc.exit_code == 2
        return
    assert pairs.dtype == np.int32 and pairs.ndim == 2 and pairs.shape[1] == 2 and len(pairs)
    assert pairs.min() >= 0
    if n_layers is not None and n_experts is not None:
        assert pairs[:, 0].max() <= n_layers and pairs[:, 1].max() < n_experts


def seeds() -> list[bytes]:
    pairs = np.array([[1, 3], [1, 5], [2, 0], [92, 895]], dtype="<i4")
    return [b"\x00" + pairs.tobytes(), b"\x01" + pairs.tobytes(), b"\x02" + pairs[:3].tobytes()]


if __name__ == "__main__":
    main(one_input, seeds(), "trace")
