"""Continuous batching in a real server: concurrent requests from the official client share
passes and each gets the ids it gets alone; a client gone mid-prompt is cancelled between
two chunks and the server goes on; bad --max-batch values are refused before it starts."""

from __future__ import annotations

import http.client
import json
import threading

import pytest
from conftest import Served, k3_inprocess

PROMPTS = [[3 + i, 7, 11 + 2 * i, 5, i % 4 + 1] for i in range(6)]


@pytest.fixture(scope="module")
def batched(tiny_model):
    s = Served(tiny_model, "--max-batch", "4", "--prefix-cache-gb", "0", "--prefill-chunk", "4")
    yield s
    s.stop()


def test_concurrent_requests_share_passes_and_keep_their_ids(batched, engine):
    import openai

    client = openai.OpenAI(base_url=f"http://{batched.base}", api_key="none", max_retries=0)
    want = [engine.generate(p, max_tokens=12, ignore_eos=True).ids for p in PROMPTS]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(PROMPTS))

    def one(i: int) -> None:
        try:
            start.wait()
            r = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
            got[i] = r.model_extra["k3"]["completion_ids"]
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [got[i] for i in range(len(PROMPTS))] == want
    health = batched.get("/health")
    assert health["batch"]["max_batch"] == 4
    assert 1 < health["batch"]["largest"] <= 4, health["batch"]


def test_a_client_gone_mid_prompt_is_cancelled_and_the_server_goes_on(batched, engine):
    before = batched.get("/health")["cancelled"]
    host, port = batched.base.removesuffix("/v1").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": "tiny", "prompt": [(5 * i) % 90 + 1 for i in range(800)],
                       "max_tokens": 50, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    conn.sock.close()  # gone while its 800 ids go in 4 a pass
    batched.wait_health(lambda h: h["cancelled"] > before and h["batch"]["running"] == 0,
                        timeout=60)
    after = batched.get("/health")
    assert after["status"] == "ok"
    import openai

    client = openai.OpenAI(base_url=f"http://{batched.base}", api_key="none", max_retries=0)
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert r.model_extra["k3"]["completion_ids"] == engine.generate(PROMPTS[0], max_tokens=5).ids


@pytest.mark.parametrize("value", ["0", "-1", "257"])
def test_a_bad_max_batch_is_refused_before_the_model_opens(tiny_model, value):
    res = k3_inprocess("serve", tiny_model, "--max-batch", value)
    assert res.exit_code == 2
    assert "--max-batch must be in 1..256" in res.output
