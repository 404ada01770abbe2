"""MXFP4 decoding on real released bytes: exact, and the swapped-nibble decode differs."""

from __future__ import annotations

import json

import numpy as np
from k3_backends.exact_numpy import mxfp4_to_f64

from k3core.api import contract
from k3core.api.kernels import Mxfp4


def _load(fixtures):
    f = json.loads((fixtures / "mxfp4.json").read_text())
    packed = np.asarray(f["packed"]["data"], dtype=np.uint8).reshape(f["packed"]["shape"])
    scales = np.asarray(f["scales"]["data"], dtype=np.uint8).reshape(f["scales"]["shape"])
    return f, packed, scales


def test_table_matches_fixture(fixtures):
    f, _, _ = _load(fixtures)
    assert list(contract.E2M1) == f["e2m1_lut"]


def test_decode_is_exact(fixtures):
    f, packed, scales = _load(fixtures)
    want = np.asarray(f["expected"]["data"], dtype=np.float64).reshape(f["expected"]["shape"])
    got = mxfp4_to_f64(packed, scales)
    assert got.shape == (f["rows"], f["logical_width"])
    assert np.array_equal(got, want)


def test_swapped_nibbles_differ(fixtures):
    f, packed, scales = _load(fixtures)
    swapped = ((packed & 0x0F) << 4) | (packed >> 4)
    got = mxfp4_to_f64(swapped.astype(np.uint8), scales).reshape(-1)[:64]
    assert np.array_equal(got, np.asarray(f["expected_swapped_nibbles"]["first64"]))
    assert not np.array_equal(got, mxfp4_to_f64(packed, scales).reshape(-1)[:64])


def test_matmul_from_packed_equals_decoded_product(fixtures, numpy_backend):
    _, packed, scales = _load(fixtures)
    x = np.random.default_rng(0).standard_normal((2, packed.shape[1] * 2)).astype(np.float32)
    y = numpy_backend.matmul_mxfp4(Mxfp4(packed, scales), x)
    ref = mxfp4_to_f64(packed, scales) @ x.astype(np.float64).T
    assert np.allclose(y, ref.T.astype(np.float32), rtol=1e-6, atol=1e-6)


def test_nan_scale_byte_contributes_zero(numpy_backend):
    packed = np.full((1, 16), 0x77, dtype=np.uint8)  # every code 7 -> 6.0
    scales = np.array([[255]], dtype=np.uint8)
    y = numpy_backend.matmul_mxfp4(Mxfp4(packed, scales), np.ones((1, 32), dtype=np.float32))
    assert y.tolist() == [[0.0]]
