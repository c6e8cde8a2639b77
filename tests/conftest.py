"""Fixtures shared by several test modules."""

from __future__ import annotations

import importlib
import os

import huggingface_hub
import pytest
import torch
from huggingface_hub import HfApi
from huggingface_hub.errors import EntryNotFoundError

# The HTTP client huggingface_hub sends through: httpx2 from huggingface_hub 2, httpx before (older transformers 5
# releases require huggingface_hub 1.x).
http_client = importlib.import_module("httpx2" if int(huggingface_hub.__version__.split(".")[0]) >= 2 else "httpx")


def pytest_configure(config):
    """Each of pytest-xdist's workers gets its share of the cores, and so do the processes its tests start: torch's
    default (a thread per core in every worker) oversubscribes the machine, which made the suite several times
    slower on 2 cores. A thread count set by the caller is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, threads)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def offline_hub(monkeypatch):
    """Intercept every Hub call push_to_hub makes; any real HTTP request fails the test."""
    calls = {"create_repo": [], "create_commit": [], "uploaded": {}, "http": []}

    def refuse(self, request, *args, **kwargs):
        calls["http"].append(str(getattr(request, "url", request)))
        raise RuntimeError(f"network access attempted: {request!r}")

    monkeypatch.setattr(http_client.Client, "send", refuse)
    monkeypatch.setattr(http_client.AsyncClient, "send", refuse)

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"].append((repo_id, kwargs))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, repo_id, operations, **kwargs):
        calls["create_commit"].append((repo_id, kwargs))
        for op in operations:
            source = op.path_or_fileobj
            if isinstance(source, (str, os.PathLike)):
                with open(source, "rb") as handle:
                    data = handle.read()
            elif isinstance(source, bytes):
                data = source
            else:
                data = source.read()
            calls["uploaded"][op.path_in_repo] = data
        return huggingface_hub.CommitInfo(
            commit_url=f"https://huggingface.co/{repo_id}/commit/0",
            commit_message=kwargs.get("commit_message") or "",
            commit_description="",
            oid="0" * 40,
        )

    def refuse_other(name):
        def _refuse(self, *args, **kwargs):
            raise AssertionError(f"push_to_hub unexpectedly called HfApi.{name}")

        return _refuse

    def no_remote_card(*args, **kwargs):
        raise EntryNotFoundError("no README.md on the (intercepted) Hub")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    for other in ("upload_folder", "upload_file", "create_branch", "preupload_lfs_files"):
        monkeypatch.setattr(HfApi, other, refuse_other(other))
    monkeypatch.setattr(huggingface_hub.repocard, "hf_hub_download", no_remote_card)
    return calls


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a CUDA device: skipped where there is none (CI has none)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked `cuda`)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
