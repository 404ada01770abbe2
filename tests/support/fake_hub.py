"""A local fake of the Hugging Face Hub: just the endpoints ``huggingface_hub`` uses.

An in-process HTTP server on 127.0.0.1 (random port) serving, for each repository,
``GET /api/models/{repo}[/revision/{rev}]`` (model_info with per-file size, git blob id and
LFS sha256) and ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` (with ``X-Repo-Commit``,
``ETag``, ``Content-Length`` and ``Range`` support). Branches map to commits; tests can make
it publish a wrong size or checksum, or serve different bytes than it publishes. Every
request is recorded so tests can check which revision each file was fetched at.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


def git_blob(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]]  # commit -> {filename: bytes}
    refs: dict[str, str]  # branch -> commit
    lfs: set[str] = field(default_factory=set)  # filenames stored with LFS
    published_size: dict[str, int] = field(default_factory=dict)  # lie about a size
    published_sha: dict[str, str] = field(default_factory=dict)  # lie about a sha256
    served: dict[str, bytes] = field(default_factory=dict)  # serve other bytes

    def commit_of(self, rev: str) -> str | None:
        if rev in self.commits:
            return rev
        return self.refs.get(rev)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub._handle(self, body=True)

            def do_HEAD(self) -> None:
                hub._handle(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ---- request handling -------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
        if m:
            return self._info(h, m.group(1), m.group(2) or "main", body)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._file(h, m.group(1), m.group(2), m.group(3), body)
        self._error(h, 404, "EntryNotFound")

    def _error(self, h: BaseHTTPRequestHandler, code: int, kind: str) -> None:
        data = json.dumps({"error": kind}).encode()
        h.send_response(code)
        h.send_header("X-Error-Code", kind)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _info(self, h: BaseHTTPRequestHandler, repo_id: str, rev: str, body: bool) -> None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(h, 404, "RepoNotFound")
        commit = repo.commit_of(rev)
        if commit is None:
            return self._error(h, 404, "RevisionNotFound")
        siblings = []
        for name, data in sorted(repo.commits[commit].items()):
            size = repo.published_size.get(name, len(data))
            s: dict = {"rfilename": name, "size": size, "blobId": git_blob(data)}
            if name in repo.lfs:
                sha = repo.published_sha.get(name, hashlib.sha256(data).hexdigest())
                s["lfs"] = {"sha256": sha, "size": size, "pointerSize": 134}
            siblings.append(s)
        doc = json.dumps({"id": repo_id, "modelId": repo_id, "sha": commit,
                          "siblings": siblings}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(doc)))
        h.end_headers()
        if body:
            h.wfile.write(doc)

    def _file(self, h: BaseHTTPRequestHandler, repo_id: str, rev: str, name: str,
              body: bool) -> None:
        repo = self.repos.get(repo_id)
        commit = repo.commit_of(rev) if repo else None
        if repo is None or commit is None:
            return self._error(h, 404, "RepoNotFound" if repo is None else "RevisionNotFound")
        files = repo.commits[commit]
        if name not in files:
            return self._error(h, 404, "EntryNotFound")
        data = repo.served.get(name, files[name])
        etag = hashlib.sha256(files[name]).hexdigest() if name in repo.lfs else git_blob(files[name])
        start = 0
        rng = h.headers.get("Range")
        if rng and (m := re.fullmatch(r"bytes=(\d+)-", rng.strip())):
            start = min(int(m.group(1)), len(data))
        chunk = data[start:]
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{etag}"')
        h.send_header("Content-Length", str(len(chunk)))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if body:
            h.wfile.write(chunk)
