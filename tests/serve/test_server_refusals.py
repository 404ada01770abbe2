"""Every refusal of ``k3 serve``: a 4xx with an OpenAI-style error body, never a 500 or a
traceback; a non-loopback host without a key; the API key; the missing extra."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import openai
import pytest
from conftest import K3, Served, cli_env, k3_inprocess

MODEL = "tiny"


def post(server, path: str, body: object = None, raw: bytes | None = None, **kw) -> httpx.Response:
    if raw is not None:
        return httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"},
                          timeout=30, **kw)
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    return err


CASES = [
    # (path, body, status, code, words in the message)
    ("/v1/completions", b'{"model": "tiny", "prompt": "a",', 400, "invalid_json", "not valid JSON"),
    ("/v1/completions", b'[1, 2]', 400, "invalid_json", "JSON object"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a", "max_tokens": NaN}', 400, "invalid_json", "NaN"),
    ("/v1/completions", b'{"model": "tiny", "model": "tiny", "prompt": "a"}', 400, "invalid_json", "duplicate"),
    ("/v1/completions", b'\xff\xfe', 400, "invalid_json", "JSON"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "bogus": 1}, 400, "unknown_field", "bogus"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a", "x": 1}]},
     400, "unknown_field", "x"),
    ("/v1/completions", {"prompt": "a"}, 400, "missing_field", "model"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model_not_found", "gpt-4"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "a"}]},
     404, "model_not_found", "does not exist"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 5000}, 400, "invalid_value", "4096"),
    ("/v1/completions", {"model": "tiny", "prompt": [1] * 1000, "max_tokens": 100}, 400,
     "context_length_exceeded", "context"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "word " * 2000}]},
     400, "context_length_exceeded", "context"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, 400, "invalid_value", "vocabulary"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "invalid_value", "empty"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "n": 17}, 400, "invalid_value", "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "temperature": -1}, 400, "invalid_value", "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "top_p": 0}, 400, "invalid_value", "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400,
     "invalid_value", "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "invalid_value", "one prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "stop_token_ids": [5000]}, 400, "invalid_value",
     "vocabulary"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "invalid_value", "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "tool", "content": "a"}]}, 400,
     "invalid_value", "needs the tool_call_id"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "a"}]}, 400,
     "invalid_value", "role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a",
                                                             "reasoning_content": "b"}]},
     400, "invalid_value", "assistant"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}],
                              "reasoning_effort": "medium"}, 400, "invalid_value", "reasoning_effort"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}],
                              "tools": [{"type": "function"}]}, 400, "missing_field", "tools.0.function"),
]


@pytest.mark.parametrize("path,body,status,code,words", CASES, ids=[f"{i}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_requests_get_openai_error_bodies(server, path, body, status, code, words):
    if isinstance(body, bytes):
        r = post(server, path, raw=body)
    else:
        r = post(server, path, body)
    err = error_of(r, status)
    assert err["code"] == code, err
    assert words.lower() in err["message"].lower() or words == err["param"], err


def test_routes_methods_and_size(server):
    r = httpx.get(server.url + "/v1/nothing", timeout=30)
    assert error_of(r, 404)["code"] == "not_found"
    r = httpx.get(server.url + "/v1/completions", timeout=30)
    assert error_of(r, 405)["code"] == "method_not_allowed"
    r = httpx.get(server.url + "/v1/models/gpt-4", timeout=30)
    assert error_of(r, 404)["code"] == "model_not_found"
    big = b'{"model": "tiny", "prompt": "' + b"a" * (17 << 20) + b'"}'
    r = post(server, "/v1/completions", raw=big)
    assert error_of(r, 413)["code"] == "body_too_large"


def test_the_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="a", max_tokens=2000)
    assert e.value.code == "context_length_exceeded"


def test_server_is_alive_and_clean_after_refusals(server, client):
    assert server.get("/health")["status"] == "ok"
    r = client.completions.create(model=MODEL, prompt="a", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_api_key_full_queue_and_a_clean_stop_mid_stream(tiny_model):
    s = Served(tiny_model, "--api-key", "sekret", "--threads", "1", "--max-queue", "1")
    try:
        assert s.get("/health")["status"] == "ok"  # health needs no key
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.get(s.url + "/v1/models", headers=headers, timeout=30)
            assert error_of(r, 401)["code"] == "invalid_api_key"
        bad = openai.OpenAI(base_url=f"http://{s.base}", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=f"http://{s.base}", api_key="sekret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="a", max_tokens=1).usage.completion_tokens == 1
        key = {"Authorization": "Bearer sekret"}
        long = {"model": MODEL, "prompt": [4, 5], "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30, headers=key) as http:
            with http.stream("POST", s.url + "/v1/completions", json=long) as r:
                lines = r.iter_lines()  # (kept: a dropped iterator closes the response)
                next(lines)  # the one engine is busy with this stream
                busy = http.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a"})
                assert error_of(busy, 429)["code"] == "queue_full"
                busy = http.post(s.url + "/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "a"}], "stream": True})
                assert error_of(busy, 429)["code"] == "queue_full"
        s.wait_health(lambda h: h["waiting"] == 0)
        assert good.completions.create(model=MODEL, prompt="a", max_tokens=1).usage.completion_tokens == 1
        # Ctrl-C while a stream is open: the stream is told, the server stops cleanly
        with httpx.Client(timeout=30, headers=key) as http:
            with http.stream("POST", s.url + "/v1/completions", json=long) as r:
                lines = r.iter_lines()
                next(lines)
                s.proc.send_signal(signal.SIGINT)
                rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "server_stopping" in rest[-2]
    finally:
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err and "ERROR" not in err, err
    assert err.strip().endswith("k3 serve: stopped")


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*K3, "serve", *args], capture_output=True, text=True, timeout=60,
                          env=env or cli_env())


def test_non_loopback_host_needs_an_api_key(tiny_model):
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.org"):
        r = k3_inprocess("serve", tiny_model, "--host", host)
        assert r.exit_code == 2, r.output
        assert r.stderr.startswith("k3: error: --host") and "--api-key" in r.stderr
        assert r.stderr.count("\n") <= 2 and "Traceback" not in r.output
    r = _serve(str(tiny_model), "--host", "0.0.0.0")  # and the real command line says the same
    assert r.returncode == 2 and r.stderr.startswith("k3: error: --host")


@pytest.mark.parametrize("args,words", [
    (["--port", "70000"], "--port"),
    (["--context", "0"], "--context"),
    (["--max-queue", "0"], "--max-queue"),
    (["--api-key", " "], "--api-key"),
    (["--chat-format", "chatml"], "chat format"),
    (["--thinking-effort", "medium"], "low, high, max"),
])
def test_bad_serve_flags_are_refused(tiny_model, args, words):
    r = k3_inprocess("serve", tiny_model, *args)
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("k3: error:") and words in r.stderr and "Traceback" not in r.output


def test_a_missing_model_dir_is_refused(tmp_path):
    r = k3_inprocess("serve", tmp_path / "nothing")
    assert r.exit_code == 2 and "does not exist" in r.stderr and "Traceback" not in r.output


def test_a_busy_port_is_a_runtime_error(tiny_model, server):
    port = server.url.rsplit(":", 1)[1]
    r = _serve(str(tiny_model), "--port", port)
    assert r.returncode == 1 and "cannot listen" in r.stderr and "Traceback" not in r.stderr


def test_without_the_serve_extra_it_says_how_to_install_it(tiny_model):
    code = ("import sys; sys.modules['uvicorn'] = None; sys.modules['starlette'] = None\n"
            "from k3core.cli.app import main; sys.argv = ['k3', 'serve', sys.argv[1]]; main()")
    r = subprocess.run([sys.executable, "-c", code, str(tiny_model)], capture_output=True, text=True,
                       timeout=60, env=cli_env())
    assert r.returncode == 2
    assert "pip install 'k3[serve]'" in r.stderr and "Traceback" not in r.stderr
