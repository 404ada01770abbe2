"""Alignment arithmetic for unbuffered reads (O_DIRECT, FILE_FLAG_NO_BUFFERING).

Pure functions, no I/O: shared by the ``direct`` and ``unbuffered`` backends and tested on
every platform. :func:`align_up` is k3's own (``k3.plugin.align_up``, the one rounding rule
of the packed trunk and the expert slots too); the rest is the unbuffered reads' own.

An unbuffered read must start at an aligned file offset, ask for an aligned length and land
in an aligned buffer. To read an arbitrary payload ``[offset, offset + nbytes)`` the read is
widened outward to the enclosing aligned *window* ``[start, start + length)``; the payload
then sits at ``payload_offset`` inside the window. Near the end of the file the kernel
delivers only ``file_size - start`` bytes of the window: that is fine as long as the payload
itself was covered (``required`` bytes arrived).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from k3.plugin import align_up

#: the most one read syscall may ask for (Darwin rejects >= 2 GiB; Windows takes a DWORD)
MAX_SYSCALL_BYTES = 1 << 30
#: the default per-syscall chunk
DEFAULT_CHUNK_BYTES = 64 << 20


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_align(align: int) -> int:
    """Return ``align`` if it is a power of two, else raise ``ValueError``."""
    if not is_pow2(align):
        raise ValueError(f"alignment must be a power of two, got {align}")
    return align


def align_down(x: int, align: int) -> int:
    return x & ~(align - 1)


def is_aligned(x: int, align: int) -> bool:
    return x & (align - 1) == 0


@dataclass(frozen=True)
class Window:
    """The aligned read that covers one payload.

    ``start`` and ``length`` are multiples of the alignment; the payload is
    ``[payload_offset, payload_offset + nbytes)`` inside the window. ``expected`` is how many
    bytes of the window exist in the file (``length`` unless the window runs past EOF) and
    ``required`` is the least that must arrive for the payload to be complete.
    """

    start: int
    length: int
    payload_offset: int
    nbytes: int
    expected: int

    @property
    def required(self) -> int:
        return self.payload_offset + self.nbytes

    @property
    def end(self) -> int:
        return self.start + self.length


def aligned_window(offset: int, nbytes: int, file_size: int, align: int) -> Window:
    """The enclosing aligned window of ``[offset, offset + nbytes)`` in a ``file_size`` file.

    Raises ``ValueError`` for a negative length, a range outside the file, or an alignment
    that is not a power of two. A zero-length payload gets a zero-length window.
    """
    check_align(align)
    if nbytes < 0 or offset < 0 or offset + nbytes > file_size:
        raise ValueError(
            f"range [{offset}, {offset + nbytes}) is outside a file of {file_size} bytes"
        )
    if nbytes == 0:
        return Window(offset, 0, 0, 0, 0)
    start = align_down(offset, align)
    end = align_up(offset + nbytes, align)
    expected = min(end, file_size) - start
    return Window(start, end - start, offset - start, nbytes, expected)


def chunk_limit(max_chunk: int, align: int) -> int:
    """A per-syscall size: ``max_chunk`` capped at 1 GiB, rounded down to ``align`` (>= align)."""
    check_align(align)
    if max_chunk <= 0:
        raise ValueError(f"chunk size must be positive, got {max_chunk}")
    return max(align, align_down(min(max_chunk, MAX_SYSCALL_BYTES), align))


def chunks(offset: int, nbytes: int, max_chunk: int) -> Iterator[tuple[int, int]]:
    """Split ``[offset, offset + nbytes)`` into ``(offset, length)`` pieces of <= ``max_chunk``.

    If ``offset`` and ``max_chunk`` are aligned, every piece but the last starts and ends
    aligned. Yields nothing for ``nbytes == 0``.
    """
    if max_chunk <= 0:
        raise ValueError(f"chunk size must be positive, got {max_chunk}")
    pos, end = offset, offset + nbytes
    while pos < end:
        n = min(max_chunk, end - pos)
        yield pos, n
        pos += n


@dataclass(frozen=True)
class Split:
    """A payload cut into an unaligned head, an aligned body and an unaligned tail.

    Used when the destination address and the file offset are congruent modulo the
    alignment: the body ``[body_offset, body_offset + body_len)`` (file offsets) can then be
    read straight into the caller's buffer, and only head and tail go through a bounce
    buffer. ``head`` and ``tail`` are ``(file_offset, nbytes)``; either may be empty.
    """

    head: tuple[int, int]
    body_offset: int
    body_len: int
    tail: tuple[int, int]


def split_payload(offset: int, nbytes: int, align: int) -> Split:
    """Cut ``[offset, offset + nbytes)`` at the first and last aligned boundary inside it."""
    check_align(align)
    end = offset + nbytes
    body_start = align_up(offset, align)
    body_end = align_down(end, align)
    if body_end <= body_start:  # no whole aligned block inside: all of it is "head"
        return Split((offset, nbytes), end, 0, (end, 0))
    return Split(
        (offset, body_start - offset),
        body_start,
        body_end - body_start,
        (body_end, end - body_end),
    )
