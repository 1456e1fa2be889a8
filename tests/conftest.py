"""Shared fixtures: the demo models, engines built from them at any TP size (built once per session), and one
tritonserver over them for the server tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors in Triton's interpreter (read at its import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from splitspec.build.engines import build_pair
from splitspec.demo.pair import make_demo_models

torch.set_num_threads(max(1, (os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    """Skip the ``gpu`` tests cleanly on machines without CUDA (CI has none)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory) -> Path:
    """The demo target + drafter + tokenizer (Hugging Face formats), generated once per test session.

    ``$SPLITSPEC_DEMO_MODELS`` names a folder ``splitspec demo-models`` wrote (e.g. ``models/demo`` carried to a GPU
    machine, whose library versions miss the training cache): used as it is, nothing trained."""
    given = os.environ.get("SPLITSPEC_DEMO_MODELS")
    if given:
        folder = Path(given).absolute()
        if not (folder / "target" / "config.json").is_file() or not (folder / "drafter" / "config.json").is_file():
            raise pytest.UsageError(f"SPLITSPEC_DEMO_MODELS={given}: expected a demo-models folder with target/ and drafter/")
        return folder
    out = tmp_path_factory.mktemp("models") / "demo"
    make_demo_models(out, seed=0)
    return out


@pytest.fixture(scope="session")
def engines_for(demo_models, tmp_path_factory):
    """``engines_for(tp, ep=1)`` → folder with ``target/`` (TP-tp) and ``drafter/`` engines, built once each."""
    cache: dict[tuple[int, int], Path] = {}

    def get(tp: int, ep: int = 1) -> Path:
        if (tp, ep) not in cache:
            cache[(tp, ep)] = build_pair(demo_models, tmp_path_factory.mktemp(f"tp{tp}ep{ep}"), tp_size=tp, ep_size=ep,
                                         max_batch_size=2, max_seq_len=256)
        return cache[(tp, ep)]

    return get


@pytest.fixture(scope="session")
def built_engines(engines_for) -> Path:
    """The default deployment: target TP2, drafter TP1."""
    return engines_for(2)


class SharedServer:
    """One tritonserver serving the default test deployment (target TP2 + TP1 drafter on CPU, k = 4, continuous
    batching up to 64 sequences with a KV budget of 80 tokens each), shared by every module that only needs a
    running server: starting one (three Python stubs, the engine process and its worker) is the slowest step of
    the server tests. :meth:`get` starts it on first use, and again after a test stopped or replaced it."""

    num_draft_tokens = 4
    max_batch_size = 64
    kv_tokens = 64 * 80

    def __init__(self, repo: Path):
        self.repo = repo
        self.srv = None

    def get(self):
        from splitspec.serving.tritonserver import TritonServer

        if self.srv is None or not self.srv.is_running():
            if self.srv is not None:
                self.srv.stop()  # whatever a stopped or crashed one left (safe twice)
            self.srv = TritonServer(self.repo, exit_timeout_s=10, startup_timeout_s=300).start()
        return self.srv

    def stop(self) -> None:
        if self.srv is not None:
            self.srv.stop()


@pytest.fixture(scope="session")
def shared_server(built_engines, tmp_path_factory):
    """The session's :class:`SharedServer` (started on first ``get()``; stopped at the end of the session)."""
    from splitspec.serving.repo import render_repo
    from splitspec.settings import ServeConfig

    cfg = ServeConfig(built_engines, num_draft_tokens=SharedServer.num_draft_tokens,
                      max_batch_size=SharedServer.max_batch_size, kv_tokens=SharedServer.kv_tokens)
    repo = render_repo(cfg, tmp_path_factory.mktemp("shared_server") / "repo")
    shared = SharedServer(repo)
    yield shared
    shared.stop()
