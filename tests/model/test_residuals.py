"""BlockStack hands attn_res the same sources as stacking the completed blocks and x afresh."""

from __future__ import annotations

import numpy as np
import pytest

from k3core.model.residuals import BlockStack


def test_sources_equal_a_fresh_stack_through_appends_and_trims() -> None:
    rng = np.random.default_rng(0)
    T, E = 5, 7
    st, blocks = BlockStack(T, E, 4), []
    for step in range(6):
        x = rng.standard_normal((T, E)).astype(np.float32)
        if blocks:
            assert np.array_equal(st.sources(x), np.stack(blocks + [x]))
        if step % 2 == 0 and len(blocks) < 3:  # x completes a block, as at a block's first layer
            st.append(x)
            blocks.append(x)
        y = rng.standard_normal((T, E)).astype(np.float32)
        assert np.array_equal(st.sources(y), np.stack(blocks + [y]))
        assert len(st) == len(blocks)
    st.keep_rows(np.arange(T - 2, T))
    blocks = [b[-2:] for b in blocks]
    z = rng.standard_normal((2, E)).astype(np.float32)
    assert np.array_equal(st.sources(z), np.stack(blocks + [z]))


def test_an_array_changed_in_place_between_calls_is_read_again() -> None:
    st = BlockStack(2, 3, 3)
    h = np.arange(6, dtype=np.float32).reshape(2, 3)
    st.sources(h)
    h += 1  # e.g. a layer hook that edits the hidden state in place
    st.append(h)
    x = np.full((2, 3), 9, dtype=np.float32)
    assert np.array_equal(st.sources(x), np.stack([h, x]))
    x -= 4
    assert np.array_equal(st.sources(x), np.stack([h, x]))


def test_more_blocks_than_the_capacity_is_an_error() -> None:
    st = BlockStack(1, 1, 2)
    st.append(np.zeros((1, 1), dtype=np.float32))
    with pytest.raises(IndexError):
        st.append(np.zeros((1, 1), dtype=np.float32))
