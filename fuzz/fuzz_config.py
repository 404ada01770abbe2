"""Fuzz the config reader (``config.json``: nested released layout or flat fixture layout).

Input: the file's bytes. An accepted config must survive its own round trip.
"""

from __future__ import annotations

from fuzz_common import instrumented, main, quiet, tiny_model

with instrumented(__name__):
    from k3core.api.errors import K3Error
    from k3core.model.config import ModelConfig


def one_input(data: bytes) -> None:
    try:
        with quiet():
            cfg = ModelConfig.from_json_bytes(data, source="fuzz.json")
    except K3Error as exc:
        assert exc.message
        return
    assert 1 <= cfg.n_layers and cfg.hidden > 0 and cfg.vocab > 0
    assert 0 < cfg.topk <= cfg.n_experts or cfg.n_experts == 0


def seeds() -> list[bytes]:
    model, _ = tiny_model()
    return [(model / "config.json").read_bytes(), b"{}", b'{"text_config": {}}']


if __name__ == "__main__":
    main(one_input, seeds(), "config", json_dict=True)
