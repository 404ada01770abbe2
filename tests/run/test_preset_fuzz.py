"""Fuzz the preset reader: every input ends in a valid Preset or a K3Error, never anything else.

10,000 cases in all (structured documents, mangled valid text, raw bytes), derandomized so
a CI failure reproduces; about 15 s on two cores, most of it Hypothesis's own overhead.
"""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3core.api.errors import K3Error
from k3core.run.presets import Preset, parse_preset

KEYS = list(Preset.model_fields) + ["trunk_gib", "extra", "Name", "", "name "]
scalars = st.one_of(
    st.sampled_from([None, True, False, 0, 1, -1, 3, 2.5, 0.31, 1e300, float("nan"),
                     float("inf"), "laptop", "numpy", "auto", "x" * 300, "a b", "0", "1e9",
                     "line\nbreak", "\x07"]),
    st.integers(-10**20, 10**20), st.floats(), st.text(max_size=12),
)
values = st.one_of(scalars, st.lists(scalars, max_size=2))
documents = st.dictionaries(st.sampled_from(KEYS), values, max_size=7)
VALID = "name: ok\ntrunk_gb: 3\ncache_gb: 1\n"
SNIPPETS = ["&a ", "*a", "!!python/object:os.system ", "!!binary ", "!custom ", "? ", "- ",
            "{", "}", "[", "]", ": ", "\n", "\t", "'", '"', "%YAML 1.1\n", "---\n", "...\n",
            "<<: ", "\x00", "\ufeff", "#", "|\n  ", ">\n  ", "!!float ", "0x1F", ".nan"]


def _check(text: str | bytes) -> None:
    try:
        p = parse_preset(text, "fuzz.yaml")
    except K3Error as exc:
        assert exc.exit_code == 2 and str(exc).startswith("fuzz.yaml")
        return
    assert isinstance(p, Preset) and p.trunk_gb > 0


def fuzz(n: int) -> settings:
    return settings(max_examples=n, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


@fuzz(4_500)
@given(documents)
def test_structured_documents(doc):
    _check(yaml.safe_dump(doc, allow_unicode=True))


@fuzz(4_500)
@given(st.lists(st.one_of(st.sampled_from(SNIPPETS), st.text(max_size=4)), max_size=10),
       st.integers(0, len(VALID)))
def test_mangled_text(pieces, at):
    _check(VALID[:at] + "".join(pieces) + VALID[at:])


@fuzz(1_000)
@given(st.binary(max_size=80))
def test_raw_bytes(data):
    _check(data)
