"""A streamed run's tables: lm_head resident, embedding rows read per token, same bits."""

from __future__ import annotations

import numpy as np
import pytest
from k3_storage.plain import PlainStorage

from k3core.api.errors import K3Error
from k3core.checkpoint.index import CheckpointIndex
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.sources import ModelTables
from k3core.plugins.registry import get_registry
from k3core.testing.faulty_backend import available_storage
from k3core.tools.synth.writer import synthesize
from k3core.trunk.row_embed import RowEmbedTables


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg = ModelConfig.from_json_dict(size_config("tiny"))
    return cfg, synthesize(tmp_path_factory.mktemp("rows") / "tiny", cfg, 4)


@pytest.mark.parametrize("storage", available_storage())
def test_rows_equal_the_resident_table_bits(model, storage) -> None:
    cfg, d = model
    backend, _, _ = get_registry().create("storage", storage)
    ids = np.array([0, 5, 5, cfg.vocab - 1, 17], dtype=np.int64)
    with CheckpointIndex.open(d, PlainStorage()) as a, CheckpointIndex.open(d, backend) as b:
        want, got = ModelTables(cfg, a), RowEmbedTables(cfg, b)
        assert got.embed(ids).tobytes() == want.embed(ids).tobytes()
        assert got.head_w.tobytes() == want.head_w.tobytes()
        assert got.fold_out.tobytes() == want.fold_out.tobytes()
        assert got.resident_bytes < want.embed_w.nbytes + want.head_w.nbytes
        assert got.embedding_bytes_read == len(ids) * cfg.hidden * 2
        with pytest.raises(K3Error, match="outside the vocabulary"):
            got.embed(np.array([cfg.vocab]))
