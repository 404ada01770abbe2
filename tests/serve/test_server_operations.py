"""Operating ``k3 serve``: ``/metrics`` scraped after real requests, one log line per
request, ``/tokenize`` and ``/detokenize``, CORS off by default and on for the origins
given, the API key on the new routes, and the chat page's bytes and headers."""

from __future__ import annotations

from importlib import resources

import httpx
import pytest
from conftest import Served, k3_inprocess
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny"
PAGE = "http://page.test:5173"


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(url: str, **kw) -> Samples:
    r = httpx.get(url + "/metrics", timeout=30, **kw)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    return parse(r.text)


def value(m: Samples, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(a: Samples, b: Samples, name: str, **labels: str) -> float:
    return value(b, name, **labels) - value(a, name, **labels)


def test_metrics_count_real_requests_and_each_gets_a_log_line(server, client):
    before = scrape(server.url)
    done = client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=5, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 5
    figures = done.model_extra["k3"]["figures"]
    assert figures["expert_requests"] > 0 and figures["first_token_seconds"] > 0
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    assert usage.completion_tokens == 4
    f = chunks[-1].model_extra["k3"]["figures"]
    assert set(f) == {"queue_seconds", "first_token_seconds", "tokens_per_second", "expert_requests",
                      "expert_hits", "expert_misses", "bytes_read"}
    assert f["tokens_per_second"] > 0 and f["expert_hits"] + f["expert_misses"] <= f["expert_requests"]
    assert httpx.get(server.url + "/no/such/route", timeout=30).status_code == 404
    assert httpx.post(server.url + "/v1/completions", json={"model": MODEL}, timeout=30).status_code == 400
    after = scrape(server.url)

    def requests(route: str, method: str, status: int) -> float:
        return delta(before, after, "k3_requests_total", route=route, method=method, status=str(status))

    assert requests("/v1/completions", "POST", 200) == 1
    assert requests("/v1/chat/completions", "POST", 200) == 1
    assert requests("/v1/completions", "POST", 400) == 1
    assert requests("other", "GET", 404) == 1
    assert requests("/metrics", "GET", 200) == 1  # the first scrape, counted once it ended
    assert delta(before, after, "k3_generated_tokens_total") == 5 + 4
    assert delta(before, after, "k3_prompt_tokens_total") == 3 + usage.prompt_tokens
    assert delta(before, after, "k3_generations_total", finish="length") == 2
    assert delta(before, after, "k3_time_to_first_token_seconds_count") == 2
    assert delta(before, after, "k3_inter_token_latency_seconds_count") == (5 - 1) + (4 - 1)
    assert delta(before, after, "k3_time_to_first_token_seconds_sum") > 0
    for idle in ("k3_queue_depth", "k3_requests_running", "k3_batch_size"):
        assert value(after, idle) == 0, idle
    looked = delta(before, after, "k3_expert_requests_total")
    assert looked == figures["expert_requests"] + f["expert_requests"]
    hits = delta(before, after, "k3_expert_cache_hits_total")
    assert 0 <= hits + delta(before, after, "k3_expert_cache_misses_total") <= looked
    for what in ("trunk", "experts"):
        assert ("k3_read_bytes_total", (("what", what),)) in after
        assert ("k3_io_exposed_wait_seconds_total", (("what", what),)) in after
    # one line per request on stderr: route, status, how the generation finished, tokens, seconds
    line = server.wait_line(lambda s: "POST /v1/completions 200 length prompt 3 " in s
                            and "+ 5 tokens" in s)  # (a kept prefix may show as "(2 reused)")
    assert line.startswith("k3 serve: INFO: ") and line.rstrip().endswith(" s")
    server.wait_line(lambda s: "POST /v1/chat/completions 200 length prompt "
                     f"{usage.prompt_tokens}" in s and "+ 4 tokens" in s)
    server.wait_line(lambda s: "GET /no/such/route 404" in s)


def test_two_apps_in_one_process_keep_their_own_metrics(engine):
    from starlette.testclient import TestClient

    from k3core.serve.app import create_app
    from k3core.serve.service import Service
    from k3core.serve.worker import Worker

    apps = [create_app(Service(Worker(engine, 256), engine.tokenizer, MODEL), cors_origins=origins)
            for origins in (["*"], [])]
    try:
        with TestClient(apps[0]) as a, TestClient(apps[1]) as b:
            r = a.post("/v1/completions", json={"model": MODEL, "prompt": [4, 5], "max_tokens": 2})
            assert r.status_code == 200, r.text
            ma, mb = parse(a.get("/metrics").text), parse(b.get("/metrics").text)
            assert value(ma, "k3_generated_tokens_total") == 2 and value(mb, "k3_generated_tokens_total") == 0
            # --cors-origin '*': any page; none: no CORS header at all
            pre = {"Origin": "http://anywhere.test", "Access-Control-Request-Method": "POST"}
            assert a.options("/v1/completions", headers=pre).headers["access-control-allow-origin"] == "*"
            assert "access-control-allow-origin" not in b.options("/v1/completions", headers=pre).headers
    finally:
        for app in apps:
            app.state.server.executor.shutdown(wait=True)


def test_tokenize_and_detokenize_round_trip(server, engine):
    tok = engine.tokenizer
    for text in ("Hello, world!", "héllo wörld 😀 — ∑", "", "def f(x):\n    return x * 2\n"):
        r = httpx.post(server.url + "/tokenize", json={"content": text}, timeout=30)
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        assert r.json() == {"tokens": ids} and ids == tok.encode(text)
        back = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30)
        assert back.status_code == 200 and back.json() == {"content": text}
    server.wait_line(lambda s: "POST /tokenize 200" in s)


@pytest.mark.parametrize(("path", "body", "status", "code", "param"), [
    ("/tokenize", {"content": 5}, 400, "invalid_value", "content"),
    ("/tokenize", {"content": ["a"]}, 400, "invalid_value", "content"),
    ("/tokenize", {}, 400, "missing_field", "content"),
    ("/tokenize", {"content": "a", "add_special": True}, 400, "unknown_field", "add_special"),
    ("/tokenize", {"content": "ab " * 20_000}, 400, "context_length_exceeded", "content"),
    ("/detokenize", {"tokens": ["1"]}, 400, "invalid_value", "tokens.0"),
    ("/detokenize", {"tokens": [True]}, 400, "invalid_value", "tokens.0"),
    ("/detokenize", {"tokens": [1.0]}, 400, "invalid_value", "tokens.0"),
    ("/detokenize", {"tokens": "12"}, 400, "invalid_value", "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "invalid_value", "tokens"),
    ("/detokenize", {"tokens": [1 << 40]}, 400, "invalid_value", "tokens"),
    ("/detokenize", {"tokens": [1] * 1025}, 400, "context_length_exceeded", "tokens"),
])
def test_tokenize_refusals(server, path, body, status, code, param):
    err = error_of(httpx.post(server.url + path, json=body, timeout=30), status)
    assert err["code"] == code and err["param"] == param, err


def test_tokenize_refuses_before_tokenizing_a_huge_text(server):
    err = error_of(httpx.post(server.url + "/tokenize", json={"content": "x" * 8_000_000}, timeout=30), 400)
    assert err["code"] == "context_length_exceeded" and "before tokenizing" in err["message"], err
    assert error_of(httpx.get(server.url + "/tokenize", timeout=30), 405)["code"] == "method_not_allowed"


def test_cors_is_off_by_default(server):
    pre = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=pre, timeout=30)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = httpx.get(server.url + "/v1/models", headers={"Origin": PAGE}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_origins_and_the_key_on_every_new_route(tiny_model):
    s = Served(tiny_model, "--threads", "1", "--api-key", "sekret", "--cors-origin", PAGE,
               "--cors-origin", "https://other.test")
    key = {"Authorization": "Bearer sekret"}
    try:
        pre = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
        r = httpx.options(s.url + "/v1/chat/completions", headers=pre, timeout=30)  # no key needed
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == PAGE
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        other = httpx.options(s.url + "/v1/chat/completions", timeout=30,
                              headers={**pre, "Origin": "http://evil.test"})
        err = error_of(other, 400)
        assert err["code"] == "cors_refused" and "origin" in err["message"], err
        assert "access-control-allow-origin" not in other.headers
        # answers to the allowed page carry the header, refusals too (the page can read them)
        ok = httpx.get(s.url + "/v1/models", headers={"Origin": PAGE, **key}, timeout=30)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == PAGE
        no = httpx.get(s.url + "/v1/models", headers={"Origin": PAGE}, timeout=30)
        assert error_of(no, 401)["code"] == "invalid_api_key"
        assert no.headers["access-control-allow-origin"] == PAGE
        # the new routes want the key like /v1; the page itself and /health do not
        for method, path, body in (("POST", "/tokenize", {"content": "a"}),
                                   ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/metrics", None)):
            assert error_of(httpx.request(method, s.url + path, json=body, timeout=30), 401)["code"] == \
                "invalid_api_key"
            assert httpx.request(method, s.url + path, json=body, headers=key, timeout=30).status_code == 200
        assert httpx.get(s.url + "/", timeout=30).status_code == 200
        m = scrape(s.url, headers=key)
        assert value(m, "k3_requests_total", route="/v1/chat/completions", method="OPTIONS", status="400") == 1
        assert value(m, "k3_requests_total", route="/metrics", method="GET", status="401") == 1
    finally:
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err
    assert err.startswith("k3 serve: tiny (") and "http://127.0.0.1:" in s.line  # the banner: stderr


@pytest.mark.parametrize("origin", ["page.test", "http://page.test/", "http://page.test/app",
                                    "ftp://page.test", "http://", "http://page.test:99999", " http://a.test",
                                    "http://user@page.test", "http://page.test?x=1"])
def test_a_bad_cors_origin_is_refused(tiny_model, origin):
    r = k3_inprocess("serve", tiny_model, "--cors-origin", origin)
    assert r.exit_code == 2, r.output
    assert "k3: error: --cors-origin" in r.output and "is not an origin" in r.output


def test_the_chat_page_is_the_shipped_file(server):
    r = httpx.get(server.url + "/", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    shipped = resources.files("k3core.serve").joinpath("static/chat.html").read_bytes()
    assert r.content == shipped
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "'sha256-" in csp
    assert "unsafe-inline" not in csp
    # self-contained: nothing is loaded from anywhere else
    for outside in (b"http://", b"https://", b"src=", b"@import"):
        assert outside not in shipped, outside
    assert httpx.head(server.url + "/", timeout=30).status_code == 200
