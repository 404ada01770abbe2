"""``--spec ngram|auto`` through the run pipeline: the ids of ``--spec off`` on every kernel
backend, resident and streamed trunk, a small expert cache, incremental and full recompute,
greedy and sampled; stops and lengths hold; the session's state after a pass is the plain
run's; bad values are refused with one line and exit 2. On the trained demo model, so the
n-gram drafts of a repetitive code prompt are really accepted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import k3
from k3core.api.errors import UsageError
from k3core.cli.app import app
from k3core.plugins.registry import get_registry
from k3core.run.request import GenerationParams, build

DEMO = Path(__file__).resolve().parents[2] / "demo-model"
CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n")
N = 48  # long enough that the demo model repeats itself and the drafts are taken
M = 12  # tokens of each run of the backend x configuration matrix


def backends() -> list[str]:
    reg = get_registry()
    return [n for n in ("numpy", "numba", "avx2")
            if n in reg.names("kernel") and reg.probe("kernel", n).ok]


CONFIGS = {
    "resident": {},
    "streamed-small-cache": {"trunk_gb": 0.0012, "cache_gb": 0.0004},
    "full-recompute": {"incremental": False},
}


FAST = "avx2" if "avx2" in backends() else "numba" if "numba" in backends() else "numpy"


#: the default suite's share (every config once, on a compiled backend); make test-long runs all
DEFAULT_SHARE = {(FAST, "resident"), (FAST, "streamed-small-cache"),
                 ("numba" if "numba" in backends() else FAST, "full-recompute")}


def matrix() -> list[object]:
    slow = pytest.mark.slow
    return [pytest.param(b, c, marks=[] if (b, c) in DEFAULT_SHARE else [slow])
            for b in backends() for c in sorted(CONFIGS)]


@pytest.fixture(scope="module")
def trunk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("spec") / "trunk"
    res = CliRunner().invoke(app, ["pack-trunk", str(DEMO), str(out)])
    assert res.exit_code == 0, res.output
    return out




@pytest.mark.parametrize(("backend", "config"), matrix())
def test_ids_identical_to_spec_off(backend: str, config: str, trunk: Path) -> None:
    opts = dict(CONFIGS[config])
    if "trunk_gb" in opts:
        opts["trunk"] = trunk
    with k3.load(DEMO, backend=backend, **opts) as eng:
        for sampling in ({}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}):
            off = eng.generate(CODE, max_tokens=M, ignore_eos=True, **sampling)
            for mode in ("ngram", "auto") if not sampling else ("ngram",):
                on = eng.generate(CODE, max_tokens=M, ignore_eos=True, spec=mode, **sampling)
                assert on.ids == off.ids, (mode, sampling)
                assert on.first_logits.tobytes() == off.first_logits.tobytes()
                rec = on.report["speculative"]
                assert rec["mode"] == mode and on.spec is not None
                if mode == "ngram" and not sampling:
                    assert rec["drafts_accepted"] > 0 and rec["passes"] < M
            if "trunk_gb" in opts:
                assert off.report["trunk_bytes_read"] > 0


def state_bytes(session: k3.Session) -> list[bytes]:
    st = session.state
    assert st is not None
    out = [bytes(st.pos)]
    for L in sorted(st.kda):
        out += [st.kda[L].S.tobytes()] + [st.kda[L].conv[n].tobytes() for n in "qkv"]
    for L in sorted(st.kv):
        out.append(st.kv[L].rows[: st.pos].tobytes())
    return out


def test_session_calls_and_state_match_plain() -> None:
    with k3.load(DEMO, backend=FAST) as eng:
        plain, spec = eng.session(), eng.session()
        a = plain.generate(CODE, max_tokens=10, ignore_eos=True)
        b = spec.generate(CODE, max_tokens=10, ignore_eos=True, spec="ngram", spec_width=6)
        assert a.ids == b.ids and plain.ids == spec.ids
        assert state_bytes(plain) == state_bytes(spec)
        a = plain.generate("\n\ndef ", max_tokens=12, ignore_eos=True)
        b = spec.generate("\n\ndef ", max_tokens=12, ignore_eos=True, spec="ngram")
        assert a.ids == b.ids and state_bytes(plain) == state_bytes(spec)
        assert b.spec is not None and b.spec.accepted > 0


def test_stops_and_length_hold() -> None:
    with k3.load(DEMO, backend=FAST) as eng:
        ref = eng.generate(CODE, max_tokens=N, ignore_eos=True)
        got = eng.generate(CODE, max_tokens=N, ignore_eos=True, spec="ngram", spec_width=8)
        assert got.ids == ref.ids and got.spec is not None and got.spec.accepted > 2
        # a stop id and a stop text inside what the drafts would have carried on with
        stop = ref.ids[N // 2]
        for kw in ({"stop_ids": [stop]}, {"stop": [ref.text[len(ref.text) // 2:][:4]]}):
            a = eng.generate(CODE, max_tokens=N, ignore_eos=True, **kw)
            b = eng.generate(CODE, max_tokens=N, ignore_eos=True, spec="ngram", spec_width=8, **kw)
            assert (a.ids, a.text, a.stop_reason) == (b.ids, b.text, b.stop_reason), kw
            assert a.stop_reason != "length"
        for n in (1, 2, 5):
            a = eng.generate(CODE, max_tokens=n, ignore_eos=True, spec="ngram", spec_width=8)
            assert a.ids == ref.ids[:n]
        a = eng.generate(CODE, max_tokens=0, spec="ngram")
        assert a.stop_reason == "prefill" and not a.ids


def test_cli_record_and_table(tmp_path: Path) -> None:
    runner = CliRunner()
    recs = {}
    for mode in ("off", "ngram"):
        out = tmp_path / f"{mode}.json"
        res = runner.invoke(app, ["run", str(DEMO), "--prompt", CODE, "-n", "16", "--ignore-eos",
                                  "--spec", mode, "--backend", FAST, "--out", str(out)])
        assert res.exit_code == 0, res.output
        recs[mode] = json.loads(out.read_text())
    assert recs["ngram"]["generated_ids"] == recs["off"]["generated_ids"]
    assert recs["off"]["speculative"] is None
    spec = recs["ngram"]["speculative"]
    assert spec["drafts_accepted"] > 0 and spec["passes"] < 16
    assert set(spec["decisions"]) <= {"ngram", "no-match", "last-token"}
    assert recs["ngram"]["request"]["generation"]["spec"] == "ngram"
    off, on = recs["off"]["bytes_per_token"], recs["ngram"]["bytes_per_token"]
    assert on["passes"] == spec["passes"] and off["passes"] == 16
    assert on["trunk_touched"] < off["trunk_touched"]


@pytest.mark.parametrize("args", [["--spec", "yes"], ["--spec-width", "0"],
                                  ["--spec-width", "17"], ["--spec-ngram", "0"],
                                  ["--spec-ngram", "9"], ["--spec-width", "two"]])
def test_bad_flags_refused(args: list[str]) -> None:
    res = CliRunner().invoke(app, ["run", str(DEMO), "--ids", "3,7", "--spec", "ngram", *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert any("--spec" in ln for ln in lines), res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("bad", [{"spec": "on"}, {"spec_width": 0}, {"spec_ngram": 100},
                                 {"spec": 3}])
def test_bad_params_refused(bad: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        build(GenerationParams, bad)


def test_rows_are_bytes_of_single_steps_on_the_demo_model() -> None:
    from k3core.model.state import SequenceState

    with k3.load(DEMO, backend=FAST) as eng:
        ids = eng.tokenizer.encode(CODE)
        ref = eng.generate(ids, max_tokens=6, ignore_eos=True)
        model = eng.model
        st = SequenceState(model.cfg, len(ids) + 8)
        rows = model.forward(np.array(ids + ref.ids[:5]), st, tail=6)
        for i in range(6):
            assert int(np.argmax(rows[i])) == ref.ids[i]
        assert rows[0].tobytes() == ref.first_logits.tobytes()


def test_chat_turns_identical_with_spec() -> None:
    from k3core.serve.chat_format import chat_format_for
    from k3core.serve.conversation import Conversation

    with k3.load(DEMO, backend=FAST) as eng:
        fmt = chat_format_for(eng.tokenizer)
        plain = Conversation(eng.session(), fmt, context=1024)
        spec = Conversation(eng.session(), fmt, context=1024)
        for text in (CODE, "def pow(a, b):\n"):
            a = plain.say(text, 12)
            b = spec.say(text, 12, sampling={"spec": "ngram"})
            assert a.ids == b.ids
        assert plain.ids == spec.ids


def test_cut_short_mid_pass_keeps_the_session_exact() -> None:
    with k3.load(DEMO, backend=FAST) as eng:
        ref = eng.session()
        ref.generate(CODE, max_tokens=N, ignore_eos=True)
        s = eng.session()
        pieces = 0
        for _ in s.stream(CODE, max_tokens=N, ignore_eos=True, spec="ngram", spec_width=8):
            pieces += 1
            if pieces == 9:  # the consumer stops reading, maybe inside an accepted run
                break
        assert s.ids == ref.ids[: len(s.ids)] and s.state is not None
        assert s.state.pos == len(s.ids) - 1 and s.state.trail is None
        rest = s.generate([], max_tokens=N, ignore_eos=True, spec="ngram")
        plain = eng.session()
        plain.generate(s.ids[: len(s.ids) - len(rest.ids)], max_tokens=N, ignore_eos=True)
        assert s.ids == plain.ids and state_bytes(s) == state_bytes(plain)

        def interrupt(g: int) -> None:
            if g >= 4:
                raise KeyboardInterrupt

        s = eng.session()
        s.before_step = interrupt  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            s.generate(CODE, max_tokens=N, ignore_eos=True, spec="ngram")
        assert s.last is not None and s.last.interrupted and s.ids == ref.ids[: len(s.ids)]
