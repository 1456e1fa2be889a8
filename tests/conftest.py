"""Shared fixtures: the demo models, and engines built from them at any TP size (built once per session)."""

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


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory) -> Path:
    """The demo target + drafter + tokenizer (Hugging Face formats), generated once per test session."""
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
