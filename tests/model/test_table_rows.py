"""The embedding is gathered a row per token id through the index: the same bits as the
whole table, which is never loaded; a reader without rows loads it whole."""

from __future__ import annotations

import numpy as np
import pytest
from k3_storage.direct import DirectStorage
from typer.testing import CliRunner

from k3core.api.errors import CheckpointError, K3Error
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model import names
from k3core.model.config import load_config
from k3core.model.sources import ModelTables


class _WholeReader:
    """Only ``read`` and ``in`` (the oracle adapter's interface)."""

    def __init__(self, index):
        self.index = index

    def read(self, name):
        return self.index.read(name)

    def __contains__(self, name):
        return name in self.index


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("rows") / "small"
    assert CliRunner().invoke(app, ["synth", str(out), "--size", "small", "--seed", "1"]).exit_code == 0
    return out


def test_rows_are_the_whole_tables_bits(model) -> None:
    cfg = load_config(model)
    ids = np.array([0, 5, cfg.vocab - 1, 5, 4095])
    with CheckpointIndex.open(model, DirectStorage()) as index:
        rows = ModelTables(cfg, index)
        whole = ModelTables(cfg, _WholeReader(index))
        assert rows.embed_w is None and whole.embed_w is not None
        got, want = rows.embed(ids), whole.embed(ids)
        assert got.dtype == np.float32 and got.tobytes() == want.tobytes()
        assert rows.embed(ids.reshape(1, -1)).tobytes() == want.tobytes()
        assert rows.resident_bytes == index.info(names.LM_HEAD).nbytes + 3 * 4 * cfg.hidden
        assert whole.resident_bytes == rows.resident_bytes + index.info(names.EMBED).nbytes
        with pytest.raises(K3Error, match="outside the vocabulary"):
            rows.embed(np.array([cfg.vocab]))
        with pytest.raises(CheckpointError, match="has no row"):
            index.read_row(names.EMBED, cfg.vocab)
        with pytest.raises(CheckpointError, match="has no row"):
            index.read_row(names.NORM, 0)
