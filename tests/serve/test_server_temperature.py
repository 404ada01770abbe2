"""``k3 serve`` and tiny temperatures: below the documented minimum (1e-5) a request is
answered greedily, with the ids of ``temperature: 0``, and the server logs no NumPy warning;
out-of-range sampling values are a 400 naming the field."""

from __future__ import annotations

import httpx
from conftest import Served

IDS = [3, 7, 11, 5]


def completion(server: Served, **kw) -> dict:
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": "tiny", "prompt": IDS, "max_tokens": 6, "ignore_eos": True, **kw},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_tiny_temperatures_are_greedy_and_log_no_warning(tiny_model, engine):
    server = Served(tiny_model, "--threads", "1")
    try:
        greedy = completion(server, temperature=0)["k3"]["completion_ids"]
        assert greedy == engine.generate(IDS, max_tokens=6, ignore_eos=True).ids
        for t in (5e-324, 1e-310, 9e-6):
            got = completion(server, temperature=t, seed=3, top_p=0.9)["k3"]["completion_ids"]
            assert got == greedy, t
        r = httpx.post(server.url + "/v1/completions",
                       json={"model": "tiny", "prompt": IDS, "top_p": 1e-400}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p", r.text
    finally:
        rc, err = server.stop()
    assert rc == 0, err
    assert "Warning" not in err and "Traceback" not in err, err
