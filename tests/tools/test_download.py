"""``k3 download`` against a local fake Hub (``fake_hub.FakeHub`` on 127.0.0.1).

The real ``huggingface_hub`` client talks HTTP to the fake server, so the revision
resolution, file listing and resumable fetch are the library's own; nothing here touches
the network. The free-space function is injected.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from fake_hub import FakeHub, FakeRepo
from typer.testing import CliRunner

from k3core.api.errors import UsageError
from k3core.cli.app import app
from k3core.tools.download.fetch import RECORD, download
from k3core.tools.download.hub import DownloadError, HfHubClient

runner = CliRunner()
OLD = "a" * 40
NEW = "b" * 40
REPO = "moonshot-fake/Kimi-K3-mini"
Usage = namedtuple("Usage", "total used free")


def make_files(tag: bytes) -> dict[str, bytes]:
    shards = {f"model-0000{i}-of-00002.safetensors": os.urandom(3000 + i) + tag for i in (1, 2)}
    index = {"metadata": {"total_size": sum(map(len, shards.values()))},
             "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                            "b.weight": "model-00002-of-00002.safetensors"}}
    return {
        **shards,
        "model.safetensors.index.json": json.dumps(index).encode(),
        "config.json": b'{"model_type": "kimi_k3", "tag": "' + tag + b'"}',
        "tiktoken.model": b"abc 0\n",
        "tokenization_kimi.py": b"raise SystemExit('downloaded code was executed')\n",
    }


@pytest.fixture(autouse=True)
def offline_except_localhost(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("K3_REVISION", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # never the real Hub


@pytest.fixture
def hub(monkeypatch):
    with FakeHub() as h:
        h.repos[REPO] = FakeRepo(commits={OLD: make_files(b"old"), NEW: make_files(b"new")},
                                 refs={"main": NEW, "v1": OLD},
                                 lfs={f"model-0000{i}-of-00002.safetensors" for i in (1, 2)})
        monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
        yield h


def plenty(_path: str) -> Usage:
    return Usage(10**12, 0, 10**12)


def fetch_revisions(hub: FakeHub) -> set[str]:
    return {p.split("/resolve/")[1].split("/")[0] for _, p in hub.requests if "/resolve/" in p}


def test_success_verifies_and_pins_the_commit(hub, tmp_path):
    out = tmp_path / "model"
    res = runner.invoke(app, ["download", REPO, str(out)])
    assert res.exit_code == 0, res.output
    assert f"commit {NEW}" in res.output and "OK: 6 files" in res.output
    files = hub.repos[REPO].commits[NEW]
    for name, data in files.items():
        assert (out / name).read_bytes() == data
    assert fetch_revisions(hub) == {NEW}  # main resolved once, every file fetched by commit
    record = json.loads((out / RECORD).read_text())
    assert record["commit"] == NEW and record["checksums_verified"] is True
    assert "shards: 2 of 2" in res.output and "6 checked, 6 hashed" in res.output


def test_downloaded_code_is_never_imported(hub, tmp_path):
    out = tmp_path / "model"
    download(REPO, out, client=HfHubClient(hub.endpoint), disk_usage=plenty, log=lambda s: None)
    assert (out / "tokenization_kimi.py").is_file()
    assert "tokenization_kimi" not in sys.modules


def test_rerun_skips_complete_files(hub, tmp_path):
    out = tmp_path / "model"
    first = download(REPO, out, disk_usage=plenty, log=lambda s: None)
    assert first.fetched == 6 and first.skipped == 0
    again = download(REPO, out, disk_usage=plenty, log=lambda s: None)
    assert again.fetched == 0 and again.skipped == 6


@pytest.mark.parametrize("rev", [OLD, "v1"])
def test_revision_pinning(hub, tmp_path, rev):
    out = tmp_path / "model"
    res = runner.invoke(app, ["download", REPO, str(out), "--revision", rev])
    assert res.exit_code == 0, res.output
    assert b'"tag": "old"' in (out / "config.json").read_bytes()
    assert fetch_revisions(hub) == {OLD}


def test_allow_pattern_selects_files(hub, tmp_path):
    out = tmp_path / "model"
    res = runner.invoke(app, ["download", REPO, str(out), "--allow-pattern", "*.json"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == \
        ["config.json", "model.safetensors.index.json"]
    assert "shard count not checked" in res.output


def test_truncated_file_is_named(hub, tmp_path):
    name = "model-00002-of-00002.safetensors"
    repo = hub.repos[REPO]
    repo.served[name] = repo.commits[NEW][name][:-100]
    res = runner.invoke(app, ["download", REPO, str(tmp_path / "m")])
    assert res.exit_code == 1, res.output
    assert "verification FAILED" in res.output
    assert f"{name}: {len(repo.served[name])} bytes, the Hub says " in res.output
    assert "(-100)" in res.output
    assert not (tmp_path / "m" / RECORD).exists()
    del repo.served[name]  # the network recovers: re-running fetches only the bad file again
    res = runner.invoke(app, ["download", REPO, str(tmp_path / "m")])
    assert res.exit_code == 0, res.output
    assert "fetching again" in res.output
    assert (tmp_path / "m" / name).read_bytes() == repo.commits[NEW][name]


def test_checksum_mismatch_is_named_and_skippable(hub, tmp_path):
    name = "model-00001-of-00002.safetensors"
    repo = hub.repos[REPO]
    good = repo.commits[NEW][name]
    repo.served[name] = bytes([good[0] ^ 1]) + good[1:]
    res = runner.invoke(app, ["download", REPO, str(tmp_path / "m")])
    assert res.exit_code == 1, res.output
    bad = hashlib.sha256(repo.served[name]).hexdigest()
    assert f"{name}: sha256 {bad} does not match the published" in res.output
    res = runner.invoke(app, ["download", REPO, str(tmp_path / "m2"), "--skip-checksum"])
    assert res.exit_code == 0, res.output
    assert "checksums skipped" in res.output


def test_non_lfs_file_checked_by_git_blob_id(hub, tmp_path):
    repo = hub.repos[REPO]
    repo.served["config.json"] = b'{"model_type": "kimi_k3", "tag": "NEW"}'  # same size
    res = runner.invoke(app, ["download", REPO, str(tmp_path / "m")])
    assert res.exit_code == 1 and "config.json: " in res.output and "git blob id" in res.output


def test_published_size_disagreeing_with_the_index(hub, tmp_path):
    repo = hub.repos[REPO]
    repo.published_size["model-00001-of-00002.safetensors"] = 999_999
    with pytest.raises(DownloadError, match="the Hub says 999999"):
        download(REPO, tmp_path / "m", disk_usage=plenty, log=lambda s: None)


def test_free_space_refused_before_downloading(hub, tmp_path):
    out = tmp_path / "model"
    with pytest.raises(DownloadError) as exc:
        download(REPO, out, disk_usage=lambda p: Usage(10**6, 10**6 - 100, 100),
                 log=lambda s: None)
    assert "not enough free space" in str(exc.value) and "shortfall" in str(exc.value)
    assert exc.value.exit_code == 1
    assert fetch_revisions(hub) == set() and not out.exists()


def test_unknown_repo_and_revision_are_usage_errors(hub, tmp_path):
    res = runner.invoke(app, ["download", "nobody/nothing", str(tmp_path / "m")])
    assert res.exit_code == 2, res.output
    res = runner.invoke(app, ["download", REPO, str(tmp_path / "m"), "--revision", "nope"])
    assert res.exit_code == 2 and "no such revision" in res.output


@pytest.mark.parametrize("args", [
    ["not a repo", "d"], ["a/b/c", "d"], ["../x", "d"], ["org/name", "d", "--revision", "a b"],
    ["org/name", "d", "--allow-pattern", " "],
])
def test_bad_arguments_exit_2_without_network(tmp_path, args):
    args = [a if a != "d" else str(tmp_path / "d") for a in args]
    res = runner.invoke(app, ["download", *args])
    assert res.exit_code == 2, res.output


def test_target_that_is_a_file(hub, tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        download(REPO, f, disk_usage=plenty)


def test_file_names_escaping_the_directory_are_refused(hub, tmp_path):
    hub.repos[REPO].commits[NEW]["../escape.txt"] = b"x"
    res = runner.invoke(app, ["download", REPO, str(tmp_path / "m")])
    assert res.exit_code == 1 and "outside the model directory" in res.output
    assert not (tmp_path / "escape.txt").exists()


def test_network_failure_is_exit_1(tmp_path, monkeypatch):
    with FakeHub() as dead:
        endpoint = dead.endpoint
    monkeypatch.setenv("HF_ENDPOINT", endpoint)  # a port nobody listens on now
    res = runner.invoke(app, ["download", REPO, str(tmp_path / "m")])
    assert res.exit_code == 1, res.output
    assert "k3: error: cannot read" in res.output and not Path(tmp_path / "m").exists()
