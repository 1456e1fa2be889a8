"""Fixtures of the engine-format tests (test_formats, test_fp8_engine_kernels): the float-weight fixture set in every
published checkpoint form (:mod:`splitspec.testing.fixtures`), a prompt, and engines built from them (cached per
test module)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitspec.build.engines import build_engines
from splitspec.convert.pair import convert_pair
from splitspec.testing import fixtures


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    return fixtures.make_fixtures(tmp_path_factory.mktemp("formats") / "fixtures")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def built(fx, tmp_path_factory):
    """``built(form, tp=1, dtype="float32", drafter="drafter", **convert kwargs)`` → engines folder (cached)."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("built")

    def get(form: str, tp: int = 1, dtype: str = "float32", drafter: str = "drafter", **kw) -> Path:
        key = (form, tp, dtype, drafter, tuple(sorted(kw.items())))
        if key not in cache:
            d = root / "_".join(map(str, key[:4])) / str(len(cache))
            ckpt = d / "ckpt"
            if not ckpt.exists():
                convert_pair(fx / form, fx / drafter, ckpt, tp_size=tp, progress=False, **kw)
            cache[key] = build_engines(ckpt, d / "engines", dtype=dtype, max_batch_size=1, max_seq_len=64, progress=False)
        return cache[key]

    return get

