"""``k3 run --expert-workers``: the same ids and logit bytes as one node, the plan and the
traffic in the report and in ``--out``; the refusals (no Ray, bad counts) with exit 2."""

from __future__ import annotations

import json
import sys

from typer.testing import CliRunner

from k3core.cli.app import app

runner = CliRunner()


def k3(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_cli_run_matches_one_node(ray_session, tiny, tmp_path):
    base = ["run", tiny, "--ids", "3,7,11", "--gen", "3", "--backend", "numpy", "--storage", "mmap"]
    one = k3(*base, "--dump-logits", tmp_path / "one.bin", "--out", tmp_path / "one.json")
    assert one.exit_code == 0, one.output
    two = k3(*base, "--expert-workers", "2", "--dump-logits", tmp_path / "two.bin",
             "--out", tmp_path / "two.json")
    assert two.exit_code == 0, two.output
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    a = json.loads((tmp_path / "one.json").read_text())
    b = json.loads((tmp_path / "two.json").read_text())
    assert a["generated_ids"] == b["generated_ids"]
    c = b["cluster"]
    assert c["plan"]["workers"] == 2 and len(c["plan"]["bytes_per_worker"]) == 2
    assert c["bytes_sent_per_token"] > 0 and c["bytes_received_per_token"] > 0
    assert c["round_trips_per_token"] == 12
    real = c["traffic_real_shape"]
    assert real["bytes_per_token"] < 32_000_000 and real["round_trips_per_token"] == 92
    assert real["break_even_gbit_s"] > 0
    assert "expert plan : 2 worker(s)" in two.output
    assert "traffic (real shape, 2 worker(s))" in two.output
    assert "cluster: 2 worker(s); per token" in two.output


def test_without_ray_says_how_to_get_it(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if not installed
    res = k3("run", tiny, "--ids", "3", "--gen", "1", "--expert-workers", "2")
    assert res.exit_code == 2, res.output
    assert "need Ray" in res.output and "pip install 'k3[ray]'" in res.output
    assert "Traceback" not in res.output


def test_bad_worker_counts(ray_session, tiny):
    res = k3("run", tiny, "--ids", "3", "--gen", "1", "--expert-workers", "0")
    assert res.exit_code == 2 and "--expert-workers must be >= 1" in res.output
    res = k3("run", tiny, "--ids", "3", "--gen", "1", "--expert-workers", "9")
    assert res.exit_code == 2 and "only 8 routed experts" in res.output
    assert "Traceback" not in res.output


def test_an_address_nothing_answers_on_is_refused_at_once(ray_session, tiny):
    for address, needle in (("127.0.0.1:1", "nothing answers there"),
                            ("no-port", "expected HOST:PORT")):
        res = k3("run", tiny, "--ids", "3", "--gen", "1", "--ray-address", address)
        assert res.exit_code == 2, res.output
        assert needle in res.output and "Traceback" not in res.output
