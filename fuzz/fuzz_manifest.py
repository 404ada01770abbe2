"""Fuzz the packed trunk's manifest (``trunk.json``) against a real 2-layer checkpoint.

Input: the manifest's bytes (strict JSON, then every structural and cross check). An
accepted manifest must keep every promise the streamer relies on: layers 0..n-1 once,
aligned non-overlapping runs inside ``trunk.bin``, tensors inside their run and identical
in dtype, shape and size to the checkpoint's.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from fuzz_common import instrumented, main, tiny_model

with instrumented(__name__):
    from k3core.api.errors import CheckpointError, K3Error
    from k3core.api.safejson import JSONRejected, parse_json
    from k3core.checkpoint.index import CheckpointIndex
    from k3core.model.config import load_config
    from k3core.testing.manifest_promises import check_accepted
    from k3core.trunk.manifest import MANIFEST_NAME, parse_manifest


@cache
def env() -> tuple[Any, Any, Any]:
    from k3_storage.plain import PlainStorage

    model, trunk = tiny_model()
    return load_config(model / "config.json"), CheckpointIndex.open(model, PlainStorage()), trunk


def one_input(data: bytes) -> None:
    cfg, idx, root = env()
    try:
        try:
            doc = parse_json(data)
        except JSONRejected as exc:
            raise CheckpointError(str(exc)) from None
        man = parse_manifest(doc, root, idx, cfg, cfg.n_layers)
    except K3Error as exc:
        assert exc.message
        return
    check_accepted(man, idx)


def seeds() -> list[bytes]:
    _, trunk = tiny_model()
    return [(trunk / MANIFEST_NAME).read_bytes(), b"{}", b'{"format": "k3-trunk"}']


if __name__ == "__main__":
    main(one_input, seeds(), "manifest", json_dict=True)
