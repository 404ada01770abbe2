"""The pure alignment arithmetic shared by the unbuffered backends (k3_storage.alignment)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from k3_storage.alignment import (
    MAX_SYSCALL_BYTES,
    align_down,
    align_up,
    aligned_window,
    chunk_limit,
    chunks,
    is_aligned,
    is_pow2,
    split_payload,
)

aligns = st.integers(0, 16).map(lambda k: 1 << k)


@st.composite
def ranges(draw: st.DrawFn) -> tuple[int, int, int, int]:
    align = draw(aligns)
    size = draw(st.integers(0, 1 << 40))
    offset = draw(st.integers(0, size))
    nbytes = draw(st.integers(0, size - offset))
    return offset, nbytes, size, align


def test_examples() -> None:
    w = aligned_window(5000, 100, 1 << 20, 4096)
    assert (w.start, w.length, w.payload_offset, w.expected, w.required) == (4096, 4096, 904, 4096, 1004)
    w = aligned_window(4096, 8192, 1 << 20, 4096)  # already aligned: the window is the payload
    assert (w.start, w.length, w.payload_offset) == (4096, 8192, 0)
    w = aligned_window(10_000, 10, 10_010, 4096)  # tail window past EOF
    assert (w.start, w.length, w.expected, w.required) == (8192, 4096, 1818, 1818)
    w = aligned_window(4095, 2, 1 << 20, 4096)  # straddles one boundary: two blocks
    assert (w.start, w.length, w.payload_offset) == (0, 8192, 4095)
    assert aligned_window(7, 0, 7, 4096).length == 0


@pytest.mark.parametrize(
    "args",
    [(-1, 1, 10, 4096), (5, 6, 10, 4096), (11, 0, 10, 4096), (0, -1, 10, 4096), (0, 1, 10, 3000)],
)
def test_window_refusals(args: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        aligned_window(*args)


@given(ranges())
def test_window_properties(r: tuple[int, int, int, int]) -> None:
    offset, nbytes, size, align = r
    w = aligned_window(offset, nbytes, size, align)
    if nbytes == 0:
        assert w.length == 0 and w.required == 0
        return
    assert is_aligned(w.start, align) and is_aligned(w.length, align)
    assert w.start <= offset and offset + nbytes <= w.end  # covers the payload
    assert w.start + w.payload_offset == offset
    assert w.length < nbytes + 2 * align  # never wider than one block each side
    assert offset - w.start < align and w.end - (offset + nbytes) < align
    assert w.required <= w.expected <= w.length  # the payload lies in what the file holds
    assert w.expected == min(w.end, size) - w.start


@given(st.integers(0, 1 << 45), aligns)
def test_align_helpers(x: int, align: int) -> None:
    d, u = align_down(x, align), align_up(x, align)
    assert d <= x <= u and is_aligned(d, align) and is_aligned(u, align)
    assert x - d < align and u - x < align
    assert is_pow2(align) and not is_pow2(align * 3)


@st.composite
def chunkings(draw: st.DrawFn) -> tuple[int, int, int]:
    max_chunk = draw(st.integers(1, 1 << 31))
    return draw(st.integers(0, 1 << 40)), draw(st.integers(0, max_chunk * 300)), max_chunk


@given(chunkings())
def test_chunks_cover_exactly(r: tuple[int, int, int]) -> None:
    offset, nbytes, max_chunk = r
    pieces = list(chunks(offset, nbytes, max_chunk))
    assert sum(n for _, n in pieces) == nbytes
    pos = offset
    for off, n in pieces:
        assert off == pos and 0 < n <= max_chunk
        pos += n
    assert len(pieces) == -(-nbytes // max_chunk)


@given(st.integers(1, 1 << 34), aligns)
def test_chunk_limit(max_chunk: int, align: int) -> None:
    c = chunk_limit(max_chunk, align)
    assert is_aligned(c, align) and align <= c <= max(align, MAX_SYSCALL_BYTES)
    assert c <= max(max_chunk, align)


def test_chunk_limit_caps_at_1gib() -> None:
    assert chunk_limit(5 << 30, 4096) == 1 << 30
    assert chunk_limit(64 << 20, 4096) == 64 << 20
    with pytest.raises(ValueError):
        chunk_limit(0, 4096)
    with pytest.raises(ValueError):
        list(chunks(0, 10, 0))


@given(ranges())
def test_split_properties(r: tuple[int, int, int, int]) -> None:
    offset, nbytes, _, align = r
    sp = split_payload(offset, nbytes, align)
    (h_off, h_len), (t_off, t_len) = sp.head, sp.tail
    # head, body and tail tile the payload in order
    assert h_off == offset
    assert h_off + h_len == sp.body_offset
    assert sp.body_offset + sp.body_len == t_off
    assert t_off + t_len == offset + nbytes
    assert min(h_len, sp.body_len, t_len) >= 0
    if sp.body_len:
        assert is_aligned(sp.body_offset, align) and is_aligned(sp.body_len, align)
        assert h_len < align and t_len < align
    else:
        assert t_len == 0 and h_len == nbytes
