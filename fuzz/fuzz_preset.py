"""Fuzz the preset reader (a small YAML mapping of scalars).

Input: the file's bytes. An accepted preset has positive budgets.
"""

from __future__ import annotations

from fuzz_common import ROOT, instrumented, main, quiet

with instrumented(__name__):
    from k3core.api.errors import K3Error
    from k3core.run.presets import parse_preset


def one_input(data: bytes) -> None:
    try:
        with quiet():
            p = parse_preset(data, "fuzz.yaml")
    except K3Error as exc:
        assert exc.message and exc.exit_code == 2
        return
    assert p.trunk_gb > 0 and p.cache_gb >= 0


def seeds() -> list[bytes]:
    return [p.read_bytes() for p in sorted((ROOT / "presets").glob("*.yaml"))]


if __name__ == "__main__":
    main(one_input, seeds(), "preset")
