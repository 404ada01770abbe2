"""``k3 bench decode``: the figures it reports are present and sane, the ids are checked
against numpy, and bad arguments are refused with one line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.sizes import sizes_from_config
from k3core.tools.synth.writer import synthesize

runner = CliRunner()


#: every key of ``--json`` (``make bench`` and these tests read them; the record's parts
#: in k3core/tools/bench/decode_record.py flatten into this one object)
JSON_KEYS = {
    "model", "backend", "threads", "incremental", "trunk", "ids", "gen", "repeat", "spec",
    "expert_readers",
    "seconds_per_token", "seconds_per_token_runs", "mean_seconds_per_token",
    "mean_seconds_per_token_runs", "passes_per_token", "speculative", "calls_per_token",
    "kernel_seconds_per_token", "host_seconds_per_token", "peak_rss_bytes",
    "expert_bytes_read_per_token", "trunk_bytes_read_per_token", "bytes_touched_per_token",
    "exposed_wait_per_token", "mean_expert_bytes_read_per_token",
    "mean_trunk_bytes_read_per_token", "trunk_bytes_touched_per_token",
    "expert_bytes_touched_per_token", "trunk_exposed_wait_per_token",
    "trunk_read_seconds_per_token", "trunk_overlap",
    "bandwidth_gb_s", "bandwidth_how", "floor_seconds_per_token", "disk_read_gb_s",
    "disk_read_how", "io_floor_seconds_per_token", "disk_device", "disk_busy_share",
    "disk_gb_s_while_busy", "device_floor_seconds_per_token", "fma_peak_gmacs", "fma_how",
    "prefill_compute_floor_seconds", "decode_peak_gweights", "decode_how",
    "prefill_ids", "prefill_seconds", "prefill_seconds_runs", "prefill_tokens_per_s",
    "prefill_expert_requests", "prefill_expert_bytes_read", "prefill_expert_bytes_if_per_token",
    "prefill_chunk", "prefill_chunks", "prefill_calls", "prefill_generated_ids", "prefill_macs",
    "batch", "aggregate_tokens_per_s", "aggregate_tokens_per_s_runs", "s_per_step",
    "s_per_step_runs", "trunk_bytes_per_token", "expert_bytes_per_token",
    "batch_calls_per_token", "batch_most", "rows_per_pass", "batch_device_busy_share",
    "batch_device_rate", "batch_device_busy_per_step", "batch_trunk_wait_per_step",
    "batch_expert_wait_per_step", "batch_kernel_per_step", "batch_plan_bytes", "batch_peak_rss_bytes",
    "batch_prompts",
    "baseline_tokens_per_s", "baseline_tokens_per_s_runs", "batch_speedup",
    "batch_macs_per_step", "batch_decoded_per_step", "batch_compute_floor_per_step",
    "batch_memory_floor_per_step", "batch_disk_floor_per_step", "batch_floor_per_step",
    "batch_single_floor_per_token",
    "batch_floor_speedup",
    "context_positions", "context_seconds_per_token", "context_seconds_per_token_runs",
    "context_attention_seconds_per_token", "context_attention_seconds_per_position",
    "context_attention_floor_per_position", "context_seed_ids", "context_ids_match",
    "context_generated_ids",
    "generated_ids", "checked_against", "ids_match", "spec_ids_match", "batch_ids_match",
    "batch_generated_ids", "notes",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("bench-decode") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 3)


def test_reports_every_figure_with_ids_checked(model) -> None:
    res = runner.invoke(app, ["bench", "decode", str(model), "--backend", "numpy", "--gen", "3",
                              "--prefill", "4", "--repeat", "2", "--json", "--bandwidth-mb", "32"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output.strip().splitlines()[-1])
    assert set(doc) == JSON_KEYS  # one flat object, the keys make bench reads
    assert doc["ids_match"] is True and doc["checked_against"] == "numpy"
    assert len(doc["seconds_per_token_runs"]) == 2 and doc["seconds_per_token"] > 0
    assert doc["calls_per_token"] > 100  # every op of 13 layers is a kernel call
    assert doc["bytes_touched_per_token"] > 0 and doc["bandwidth_gb_s"] > 0
    assert doc["floor_seconds_per_token"] > 0
    assert doc["prefill_ids"] == 4 and doc["prefill_tokens_per_s"] > 0
    assert doc["prefill_expert_requests"] > 0
    assert len(doc["generated_ids"]) == 3 and len(doc["prefill_generated_ids"]) == 1
    assert doc["prefill_chunks"] == 1 and doc["prefill_chunk"] is None
    assert doc["prefill_calls"] > doc["calls_per_token"]
    # --batch 1 (the default): the batch figures are the timed runs' own, no baseline
    assert doc["batch"] == 1 and doc["batch_most"] == 1 and doc["rows_per_pass"] == 1.0
    assert doc["aggregate_tokens_per_s"] > 0 and doc["s_per_step"] == doc["seconds_per_token"]
    assert doc["baseline_tokens_per_s"] is None and doc["batch_speedup"] is None
    assert doc["batch_ids_match"] is None and doc["batch_prompts"] == [doc["ids"]]
    # a token splits into the kernel ops and the engine's own work between them
    assert 0 < doc["kernel_seconds_per_token"] < doc["seconds_per_token"] * 1.5
    assert doc["host_seconds_per_token"] > 0
    # the prefill's weight products against the FMA peak of the same threads
    sizes = sizes_from_config(ModelConfig.from_json_dict(json.loads((model / "config.json").read_text())))
    assert doc["prefill_macs"] >= sizes.trunk_bytes  # 4 tokens through every layer matrix (2-4 B a weight)
    if doc["fma_peak_gmacs"] > 0:  # measured by the avx2 module where it is built
        assert doc["prefill_compute_floor_seconds"] == pytest.approx(
            doc["prefill_macs"] / (doc["fma_peak_gmacs"] * 1e9))
        assert doc["prefill_compute_floor_seconds"] < doc["prefill_seconds"]


def test_call_counter_times_an_op_once_when_it_calls_another() -> None:
    """A fused op whose fallback calls other ops is counted per call but timed once."""
    import time

    from k3core.tools.bench.decode import CallCounter

    class Ops:
        def inner(self, x: float) -> float:
            time.sleep(0.01)
            return x

        def outer(self, x: float) -> float:
            return self.inner(x) + self.inner(x)

    ops = Ops()
    counter = CallCounter(ops)  # type: ignore[arg-type]
    assert ops.outer(1.0) == 2.0
    assert counter.calls == 3
    assert 0.02 <= counter.seconds < 0.2  # the two sleeps, not four


def test_product_macs_counts_each_matrix_of_a_call_once() -> None:
    """rows x cols x tokens per matrix, for every weight-product op; nothing for the others;
    and the counter adds an op's multiply-adds at its outermost call only."""
    import numpy as np

    from k3core.api.kernels import Mxfp4
    from k3core.tools.bench.decode import CallCounter, product_macs

    w = np.zeros((6, 8), np.uint16)
    m = Mxfp4(np.zeros((6, 16), np.uint8), np.zeros((6, 1), np.uint8))
    x3, x1 = np.zeros((3, 8), np.float32), np.zeros(8, np.float32)
    assert product_macs("matmul_bf16", (w, x3)) == 6 * 8 * 3
    assert product_macs("matmul_mxfp4", (m, x1)) == 6 * 32
    assert product_macs("matmul_many", ([w, w[:2]], x3)) == (48 + 16) * 3
    w1, w2 = np.zeros((5, 8), np.uint16), np.zeros((8, 5), np.uint16)
    assert product_macs("situ_mlp", (w1, w1, w2, x3, 4.0, 25.0)) == (2 * 40 + 40) * 3
    assert product_macs("situ_mlp_many", ([(w1, w1, w2)] * 2, [x3, x1], 4.0, 25.0)) == 120 * 4
    assert product_macs("rmsnorm", (x3, None, 1e-5)) == 0
    # the fused layer parts: a KDA mixer's eight matrices, a MoE block's up-projection
    from k3core.api.kernels import KdaWeights

    kda = KdaWeights(proj=(w, w, w, w[:2], w[:4], w), f_b=np.zeros((6, 4), np.uint16),
                     dt_bias=x1, a_log=x1, conv=(x1, x1, x1), o_norm=x1,
                     o_proj=np.zeros((8, 6), np.uint16), lower_bound=-5.0, q_scale=1.0, eps=1e-5)
    assert product_macs("kda_mix", (x3, kda, [])) == (4 * 48 + 16 + 32 + 24 + 48) * 3
    outs = np.zeros((3, 2, 6), np.float32)
    up = np.zeros((8, 6), np.uint16)
    assert product_macs("moe_combine", (x3[:, :2], outs, None, 1e-5, up, None)) == 48 * 3
    from k3core.api.kernels import MlaSeq, MlaWeights

    mla = MlaWeights(q_a=w[:4], kv_a=w, gate=w[:3], q_a_norm=x1, kv_a_norm=x1,
                     q_b=np.zeros((6, 4), np.uint16), kv_b=w, o_proj=np.zeros((8, 3), np.uint16),
                     kv_lora=4, heads=1, scale=1.0, eps=1e-5)
    seqs = [MlaSeq(2, x3, 0, 1), MlaSeq(1, x3, 0, 0)]  # three rows, one of them attending
    assert product_macs("mla_mix", (x3, mla, seqs)) == 48 * 3 + (32 + 24 + 24 + 24) * 1
    src = np.zeros((2, 3, 8), np.float32)
    assert product_macs("moe_route", (src, x1, x1, 1e-5, w, w[:2], x1, 2, True, 1.0)) == 64 * 3

    class Ops:
        def matmul_bf16(self, w: object, x: object) -> int:
            return 0

        def matmul_many(self, ws: list, x: object) -> list:
            return [self.matmul_bf16(w, x) for w in ws]

    ops = Ops()
    counter = CallCounter(ops, count_macs=True)  # type: ignore[arg-type]
    ops.matmul_many([w, w], x3)
    assert counter.calls == 3 and counter.macs == 2 * 48 * 3
    plain = Ops()
    quiet = CallCounter(plain)  # type: ignore[arg-type]  # the decode steps count no macs
    plain.matmul_many([w, w], x3)
    assert quiet.calls == 3 and quiet.macs == 0


@pytest.mark.slow
def test_chunked_prefill_is_checked_against_one_pass(model) -> None:
    """Seven prompt ids in chunks of three: three passes, the ids checked against the
    one-pass numpy run; every routed expert read at most once per chunk."""
    res = runner.invoke(app, ["bench", "decode", str(model), "--backend", "numpy", "--gen", "2",
                              "--prefill", "7", "--prefill-chunk", "3", "--repeat", "1", "--json",
                              "--bandwidth-mb", "32"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output.strip().splitlines()[-1])
    assert doc["ids_match"] is True
    assert doc["prefill_chunk"] == 3 and doc["prefill_chunks"] == 3
    assert 0 < doc["prefill_expert_bytes_read"] <= doc["prefill_expert_bytes_if_per_token"]


def test_human_report(model) -> None:
    res = runner.invoke(app, ["bench", "decode", str(model), "--backend", "numpy", "--gen", "2",
                              "--prefill", "0", "--repeat", "1", "--no-check", "--bandwidth-mb", "32"])
    assert res.exit_code == 0, res.output
    for text in ("s/token", "floor", "Python->kernel calls per token", "exposed I/O wait",
                 "inside kernel ops", "between them"):
        assert text in res.output, text
    assert "prefill" not in res.output.split("calls")[1]


@pytest.mark.parametrize("args,msg", [
    (["--gen", "1"], "--gen must be >= 2"),
    (["--repeat", "0"], "--repeat must be >= 1"),
    (["--prefill", "-1"], "--prefill must be >= 0"),
    (["--ids", "1,x"], "comma-separated integers"),
    (["--ids", "99999999"], "prompt ids must be in"),
    (["--bandwidth-mb", "0"], "--bandwidth-mb must be a positive number of MB"),
    (["--spec", "maybe"], "--spec must be one of"),
    (["--spec", "ngram", "--spec-width", "0"], "--spec-width must be in"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    (["--readers", "0"], "--readers must be in 1..64"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--ids", ","], "--ids names no id"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--batch", "-2"], "--batch must be >= 1, got -2"),
    (["--batch", "2", "--spec", "ngram"], "--batch above 1 decodes with --spec off"),
    (["--context", "1"], "every --context must be >= 2 positions"),
    (["--context", "16,x"], "--context must be comma-separated positions"),
    (["--context", "16,16"], "--context names a context twice"),
    (["--context", "16", "--spec", "ngram"], "--context decodes with --spec off"),
    (["--context", "16", "--full-recompute"], "--context needs incremental decoding"),
])
def test_bad_arguments_are_refused(model, args, msg) -> None:
    res = runner.invoke(app, ["bench", "decode", str(model), "--backend", "numpy", "--prefill", "0",
                              "--repeat", "1", "--no-check", "--bandwidth-mb", "32", *args])
    assert res.exit_code == 2, res.output
    assert "k3: error:" in res.output and msg in res.output


def test_batch_decodes_rows_together_each_checked_alone(model) -> None:
    """--batch 3: three prompts decoded in batched passes beside the single-sequence runs,
    every row's ids those of its prompt alone on numpy."""
    res = runner.invoke(app, ["bench", "decode", str(model), "--backend", "numpy", "--gen", "3",
                              "--prefill", "0", "--repeat", "1", "--json", "--bandwidth-mb", "32",
                              "--batch", "3"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output.strip().splitlines()[-1])
    assert set(doc) == JSON_KEYS
    # the batch really formed (3 unless a row was late past the scheduler's gather wait)
    assert doc["batch"] == 3 and 1 < doc["batch_most"] <= 3
    assert 1 <= doc["rows_per_pass"] <= 3
    assert doc["ids_match"] is True and doc["batch_ids_match"] is True
    prompts = doc["batch_prompts"]
    assert prompts[0] == doc["ids"] and len({tuple(p) for p in prompts}) == 3
    assert all(len(p) == len(doc["ids"]) for p in prompts)
    rows = doc["batch_generated_ids"]
    assert len(rows) == 3 and rows[0] == doc["generated_ids"] and all(len(r) == 3 for r in rows)
    assert doc["aggregate_tokens_per_s"] > 0 and doc["s_per_step"] > 0
    assert len(doc["aggregate_tokens_per_s_runs"]) == 1 == len(doc["baseline_tokens_per_s_runs"])
    assert doc["baseline_tokens_per_s"] > 0
    assert doc["batch_speedup"] == pytest.approx(doc["aggregate_tokens_per_s"]
                                                 / doc["baseline_tokens_per_s"])
    assert doc["batch_calls_per_token"] > 0 and doc["trunk_bytes_per_token"] >= 0
    # the batched engine is planned for its 3 slots, and its peak RSS is measured (Linux)
    assert doc["batch_plan_bytes"] > 0
    if Path("/proc/self/clear_refs").exists():
        assert doc["batch_peak_rss_bytes"] > 0
    assert doc["expert_bytes_per_token"] >= 0
    # where a step's time went: the waits and the kernel ops of the batched window
    assert 0 < doc["batch_kernel_per_step"] and doc["batch_trunk_wait_per_step"] == 0
    assert 0 <= doc["batch_expert_wait_per_step"] < doc["s_per_step"]
    # the floors of a batched step and of one sequence, where the machine's ceilings could
    # be measured (the avx2 backend's probes)
    if doc["fma_peak_gmacs"] > 0 and doc["decode_peak_gweights"] > 0:
        macs, decoded = doc["batch_macs_per_step"], doc["batch_decoded_per_step"]
        assert 0 < decoded < macs
        compute = ((macs - decoded) / (doc["fma_peak_gmacs"] * 1e9)
                   + decoded / (doc["decode_peak_gweights"] * 1e9))
        assert doc["batch_compute_floor_per_step"] == pytest.approx(compute)
        assert doc["batch_floor_per_step"] == max(doc["batch_compute_floor_per_step"],
                                                  doc["batch_memory_floor_per_step"],
                                                  doc["batch_disk_floor_per_step"])
        if doc["disk_read_gb_s"] > 0:  # weights read as it decodes: the disk floors count
            assert doc["batch_single_floor_per_token"] >= doc["io_floor_seconds_per_token"]
        assert doc["batch_single_floor_per_token"] >= doc["floor_seconds_per_token"] > 0
        assert doc["batch_floor_speedup"] == pytest.approx(
            3 * doc["batch_single_floor_per_token"] / doc["batch_floor_per_step"])


def test_context_runs_decode_at_built_contexts_checked_against_numpy(model) -> None:
    """--context 12,40: each context built from a seeded prefill (its latent rows repeated),
    decoded on the timed backend and again on numpy: the same ids; the report states the
    cost per context and latent attention's per position against its floor."""
    res = runner.invoke(app, ["bench", "decode", str(model), "--backend", "avx2", "--gen", "3",
                              "--prefill", "0", "--repeat", "1", "--bandwidth-mb", "32",
                              "--context", "12,40"])
    if "cannot run here" in res.output or "unavailable" in res.output:
        pytest.skip("the avx2 backend cannot run here")
    assert res.exit_code == 0, res.output
    for text in ("context     : 12 positions", "40 positions", "MLA layers",
                 "a position of context (12 -> 40)",
                 "every context's ids identical to the same context's on --backend numpy"):
        assert text in res.output, text
    res = runner.invoke(app, ["bench", "decode", str(model), "--backend", "numpy", "--gen", "3",
                              "--prefill", "0", "--repeat", "2", "--bandwidth-mb", "32", "--json",
                              "--context", "40,12", "--no-check"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output.strip().splitlines()[-1])
    assert set(doc) == JSON_KEYS
    assert doc["context_positions"] == [40, 12] and doc["context_seed_ids"] == 11
    assert all(len(r) == 2 and all(x > 0 for x in r) for r in doc["context_seconds_per_token_runs"])
    assert all(0 < a < t for a, t in zip(doc["context_attention_seconds_per_token"],
                                         doc["context_seconds_per_token"], strict=True))
    assert [len(ids) for ids in doc["context_generated_ids"]] == [3, 3]
    assert doc["context_ids_match"] is None  # --no-check


def test_a_built_context_repeats_the_seed_rows_and_ids() -> None:
    import numpy as np

    from k3core.model.state import StateSnapshot
    from k3core.tools.bench.context import stretched
    from k3core.tools.bench.decode import contexts_of

    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    kda = {0: (np.ones((1, 2, 2), np.float32), {})}
    ids, snap = stretched(StateSnapshot(3, kda, {2: rows}), [5, 6, 7], 7)
    assert ids == [5, 6, 7, 5, 6, 7, 5] and snap.pos == 7 and snap.kda is kda
    assert np.array_equal(snap.kv[2], np.concatenate([rows, rows, rows[:1]]))
    assert contexts_of("1K, 8k,100") == [1024, 8192, 100] and contexts_of("") == []


def test_decoded_weights_count_each_mxfp4_matrix_once_a_call() -> None:
    """The MXFP4 weights a product call decodes: every weight of each MXFP4 matrix it
    multiplies by at least one token, however many tokens; none of bf16 ones."""
    import numpy as np

    from k3core.api.kernels import Mxfp4
    from k3core.tools.bench.decode import decoded_weights, product_macs

    def mx(r: int, c: int) -> Mxfp4:
        return Mxfp4(np.zeros((r, c // 2), np.uint8), np.zeros((r, c // 32), np.uint8))

    bf = np.zeros((8, 64), np.uint16)
    x3, x0 = np.zeros((3, 64), np.float32), np.zeros((0, 64), np.float32)
    assert decoded_weights("matmul_mxfp4", (mx(8, 64), x3)) == 8 * 64
    assert product_macs("matmul_mxfp4", (mx(8, 64), x3)) == 3 * 8 * 64
    assert decoded_weights("matmul_mxfp4", (mx(8, 64), x0)) == 0
    assert decoded_weights("matmul_bf16", (bf, x3)) == 0
    assert decoded_weights("matmul_many", ([mx(8, 64), mx(4, 64)], x3)) == 12 * 64
    experts = [(mx(16, 64), mx(16, 64), mx(64, 16))] * 3
    xs = [x3, x0, np.zeros((1, 64), np.float32)]
    assert decoded_weights("situ_mlp_many", (experts, xs)) == 2 * 3 * 16 * 64
    assert decoded_weights("situ_mlp", (bf, bf, bf, x3)) == 0
    outs = np.zeros((3, 4, 64), np.float32)
    assert decoded_weights("moe_combine", (x3[:, :4], outs, None, 1e-5, mx(8, 64), None)) == 8 * 64
    assert decoded_weights("rmsnorm", (x3,)) == 0


def test_batch_rows_differing_from_alone_fail(model, monkeypatch) -> None:
    """A batched row whose ids differ from its prompt alone: the report says so, exit 1."""
    from k3core.tools.bench import decode

    monkeypatch.setattr(decode, "_alone_ids", lambda plan, prompts, gen, on_token:
                        [[0] * gen for _ in prompts])
    res = runner.invoke(app, ["bench", "decode", str(model), "--backend", "numpy", "--gen", "2",
                              "--prefill", "0", "--repeat", "1", "--bandwidth-mb", "32",
                              "--batch", "2"])
    assert res.exit_code == 1, res.output
    for text in ("aggregate", "s/step", "largest batch", "sequences per steady pass",
                 "batch 2 is", "NOT all identical to its prompt alone",
                 "k3: error: bench decode: batched rows' ids differ"):
        assert text in res.output, text


def test_batch_prompts_are_distinct_and_seeded() -> None:
    from k3core.api.errors import UsageError
    from k3core.tools.bench.decode import _batch_prompts

    got = _batch_prompts([3, 7], 4, 50, 0)
    assert got[0] == [3, 7] and len({tuple(p) for p in got}) == 4
    assert all(len(p) == 2 and all(0 <= i < 50 for i in p) for p in got)
    assert got == _batch_prompts([3, 7], 4, 50, 0) and _batch_prompts([3, 7], 1, 50, 0) == [[3, 7]]
    with pytest.raises(UsageError, match="distinct prompts"):
        _batch_prompts([1], 5, 4, 0)


DEMO = Path(__file__).resolve().parents[2] / "demo-model"


@pytest.mark.slow
def test_spec_on_a_code_prompt(tmp_path) -> None:
    prompt = tmp_path / "code.txt"
    prompt.write_text("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
                      "\n\ndef mul(a, b):\n")
    docs = {}
    for mode in ("off", "ngram"):
        res = runner.invoke(app, ["bench", "decode", str(DEMO), "--prompt-file", str(prompt),
                                  "--gen", "24", "--prefill", "0", "--repeat", "1", "--no-check",
                                  "--bandwidth-mb", "32", "--spec", mode, "--json"])
        assert res.exit_code == 0, res.output
        docs[mode] = json.loads(res.output.strip().splitlines()[-1])
    off, on = docs["off"], docs["ngram"]
    assert on["generated_ids"] == off["generated_ids"]
    assert off["speculative"] is None and off["passes_per_token"] == 1.0
    assert on["spec"] == "ngram" and on["speculative"]["drafts_accepted"] > 0
    assert on["speculative"]["passes"] < 24 and on["passes_per_token"] <= 1.0
    assert on["mean_seconds_per_token"] > 0
    res = runner.invoke(app, ["bench", "decode", str(DEMO), "--prompt-file", str(prompt),
                              "--gen", "6", "--prefill", "0", "--repeat", "1", "--bandwidth-mb",
                              "32", "--spec", "ngram", "--backend", "numpy"])
    assert res.exit_code == 0, res.output
    assert "ids identical to --spec off" in res.output and "passes per token" in res.output
@pytest.mark.slow
def test_streamed_trunk_reports_exposed_wait_overlap_and_peak_rss(model, tmp_path) -> None:
    trunk = tmp_path / "trunk"
    assert runner.invoke(app, ["pack-trunk", str(model), str(trunk)]).exit_code == 0
    res = runner.invoke(app, ["bench", "decode", str(model), "--backend", "numpy", "--gen", "3",
                              "--prefill", "0", "--repeat", "1", "--no-check", "--json",
                              "--bandwidth-mb", "32", "--trunk", str(trunk), "--trunk-gb",
                              "0.0006", "--cache-gb", "0.001", "--readers", "3"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output.strip().splitlines()[-1])
    assert doc["trunk_bytes_read_per_token"] > 0 and doc["trunk_read_seconds_per_token"] > 0
    assert 0 <= doc["trunk_exposed_wait_per_token"] <= doc["exposed_wait_per_token"]
    assert 0.0 <= doc["trunk_overlap"] <= 1.0
    assert doc["peak_rss_bytes"] > 10_000_000 and doc["expert_readers"] == 3
    # the disk floor: the bytes read per token over the storage's read rate on trunk.bin
    read = doc["trunk_bytes_read_per_token"] + doc["expert_bytes_read_per_token"]
    assert doc["disk_read_gb_s"] > 0 and "trunk.bin" in doc["disk_read_how"]
    assert doc["io_floor_seconds_per_token"] == pytest.approx(read / (doc["disk_read_gb_s"] * 1e9))
    # the device's own counters, where it has them (a page-cache hit reads nothing from it)
    assert 0.0 <= doc["disk_busy_share"] <= 1.1
    if doc["disk_gb_s_while_busy"] > 0:
        assert doc["disk_device"] and doc["device_floor_seconds_per_token"] == pytest.approx(
            read / (doc["disk_gb_s_while_busy"] * 1e9))
    else:
        assert doc["device_floor_seconds_per_token"] == 0.0
    human = runner.invoke(app, ["bench", "decode", str(model), "--backend", "numpy", "--gen", "2",
                                "--prefill", "0", "--repeat", "1", "--no-check",
                                "--bandwidth-mb", "32", "--trunk", str(trunk), "--trunk-gb",
                                "0.0006"])
    assert human.exit_code == 0, human.output
    assert "overlapped compute" in human.output and "peak RSS" in human.output
    assert "disk floor" in human.output and "x that floor" in human.output
