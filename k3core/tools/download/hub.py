"""The Hugging Face Hub as ``k3 download`` sees it: one manifest, then files fetched by commit.

:class:`HubClient` is the small interface the downloader needs (tests inject a fake hub
through it, or point :class:`HfHubClient` at a local HTTP server). :class:`HfHubClient`
implements it with ``huggingface_hub``: ``HfApi.model_info(..., files_metadata=True)``
resolves the revision to a 40-hex commit once and lists every file with its size, its git
blob id and, for LFS files, its published SHA-256; ``hf_hub_download(revision=<commit>,
local_dir=...)`` fetches one file (resuming an interrupted one). Nothing downloaded is ever
imported or executed: there is no ``trust_remote_code`` anywhere in k3.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from k3core.api.errors import K3Error, UsageError

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


class DownloadError(K3Error):
    """The network, the Hub or the files on disk failed us (exit 1)."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of the repository at the pinned commit."""

    name: str
    size: int | None
    sha256: str | None = None  # published for LFS files
    blob_id: str | None = None  # git blob SHA-1 (checks small, non-LFS files)


@dataclass(frozen=True)
class RepoManifest:
    repo_id: str
    commit: str
    files: tuple[RemoteFile, ...]


class HubClient(Protocol):
    def manifest(self, repo_id: str, revision: str) -> RepoManifest: ...

    def fetch(self, repo_id: str, commit: str, filename: str, local_dir: Path,
              on_bytes: Callable[[int], None] | None = None) -> Path:
        """Fetch one file into ``local_dir``; ``on_bytes(n)`` as ``n`` more bytes are there
        (a resumed file's bytes already on disk counted first)."""
        ...


def safe_relative_name(name: Any) -> str:
    """Refuse a repository file name that could land outside the target directory."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise DownloadError(f"the Hub listed an unusable file name {name!r}; refusing")
    p = PurePosixPath(name)
    if p.is_absolute() or any(part in ("", ".", "..") for part in name.split("/")) \
            or (len(name) > 1 and name[1] == ":") or p.parts[0] == ".cache":
        raise DownloadError(f"the Hub listed the file name {name!r}, which would be written "
                            "outside the model directory (or over its download metadata); "
                            "refusing")
    return name


def _lfs_sha(lfs: Any) -> str | None:
    if lfs is None:
        return None
    sha = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
    return sha.lower() if isinstance(sha, str) and re.fullmatch(r"[0-9a-fA-F]{64}", sha) else None


class HfHubClient:
    """:class:`HubClient` over ``huggingface_hub`` (``endpoint`` defaults to ``HF_ENDPOINT``)."""

    def __init__(self, endpoint: str | None = None, token: str | bool | None = None):
        # read HF_ENDPOINT now, not when huggingface_hub was first imported
        self.endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
        self.token = token

    def manifest(self, repo_id: str, revision: str) -> RepoManifest:
        from huggingface_hub import HfApi

        try:
            info = HfApi(endpoint=self.endpoint, token=self.token).model_info(
                repo_id, revision=revision, files_metadata=True)
        except Exception as exc:  # the network boundary: every failure becomes one message
            raise _translate(exc, f"cannot read {repo_id}@{revision} from the Hub") from None
        commit = getattr(info, "sha", None)
        if not isinstance(commit, str) or not COMMIT_RE.match(commit):
            raise DownloadError(f"the Hub did not resolve {repo_id}@{revision} to a commit "
                                f"(got {commit!r})")
        files = []
        for s in info.siblings or []:
            size = s.size if isinstance(s.size, int) and s.size >= 0 else None
            blob = s.blob_id if isinstance(s.blob_id, str) and COMMIT_RE.match(s.blob_id) else None
            files.append(RemoteFile(safe_relative_name(s.rfilename), size, _lfs_sha(s.lfs), blob))
        return RepoManifest(repo_id, commit, tuple(files))

    def fetch(self, repo_id: str, commit: str, filename: str, local_dir: Path,
              on_bytes: Callable[[int], None] | None = None) -> Path:
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(repo_id, filename, revision=commit,
                                        local_dir=str(local_dir), endpoint=self.endpoint,
                                        token=self.token, tqdm_class=_byte_counter(on_bytes)))
        except Exception as exc:
            raise _translate(exc, f"download of {filename} failed") from None


def _byte_counter(on_bytes: Callable[[int], None] | None) -> Any:
    """A progress-bar class for ``hf_hub_download`` (its documented ``tqdm_class``) that
    draws nothing and hands the bytes to ``on_bytes``: ``k3 download`` shows one progress
    line of its own, not the library's bars. Only the first bar of a fetch counts (a
    transfer that opens a second bar for the same bytes is not counted twice)."""
    from tqdm.auto import tqdm

    bars: list[object] = []

    class ByteCounter(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.counts = on_bytes is not None and not bars
            bars.append(self)
            if self.counts and on_bytes is not None and kwargs.get("initial"):
                on_bytes(int(kwargs["initial"]))

        def update(self, n: float | None = 1) -> bool | None:
            if self.counts and on_bytes is not None and n:
                on_bytes(int(n))
            return None

    return ByteCounter


def _translate(exc: Exception, what: str) -> K3Error:
    try:
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    except ImportError:  # older huggingface_hub
        from huggingface_hub.utils import RepositoryNotFoundError, RevisionNotFoundError
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, RevisionNotFoundError):
        return UsageError(f"{what}: no such revision ({first})")
    if isinstance(exc, RepositoryNotFoundError):
        return UsageError(f"{what}: no such repository, or it is private or gated ({first})",
                          hint="check the repo id; for a gated repo log in (HF_TOKEN)")
    if isinstance(exc, K3Error):
        return exc
    return DownloadError(f"{what}: {type(exc).__name__}: {first}",
                         hint="check the network and re-run: finished files are kept")
