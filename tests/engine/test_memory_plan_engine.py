"""The memory plan against what engines really allocate on the CPU: weight bytes equal the built rank files' tensors
(float demo engines at TP2, FP8-kept engines at TP2 and at TP4, where expert slices cut FP8 tiles and fall back to
bf16), KV bytes equal the KV tensors a loaded rank allocates, header-read INT4 bytes equal the published tensors;
``build`` refuses engines over a budget before writing anything."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from splitspec import quant
from splitspec.build import memory_plan
from splitspec.build.engines import build_engines
from splitspec.build.memory_plan import Deployment, MemoryPlanError, plan_memory
from splitspec.build.memory_report import open_target
from splitspec.build.weight_bytes import Storage, WeightFormat
from splitspec.config import TargetConfig
from splitspec.drafter_config import DrafterConfig
from splitspec.convert.pair import convert_pair
from splitspec.convert.safetensors import CheckpointReader
from splitspec.engine.rank import RankRunner
from splitspec.files import read_json
from splitspec.models import batch, fused_moe, kv
from splitspec.models.layers import TPComm
from splitspec.testing import fixtures


def tensor_bytes(path: Path) -> int:
    r = CheckpointReader.single(path)
    return sum(r.info(n).nbytes for n in r.names())


def engine_plan(engines: Path, draft_tp: int, fmt: WeightFormat, storage: Storage):
    meta, dmeta = read_json(engines / "target" / "engine.json"), read_json(engines / "drafter" / "engine.json")
    lim = meta["limits"]
    dep = Deployment(tp=meta["mapping"]["tp_size"], ep=meta["mapping"]["ep_size"], draft_tp=draft_tp,
                     max_batch_size=lim["max_batch_size"], max_seq_len=lim["max_seq_len"], max_draft_len=lim["max_draft_len"])
    return plan_memory(TargetConfig.from_dict(meta["config"]), fmt, storage, DrafterConfig.from_dict(dmeta["config"]), dep,
                       on_gpu=False)


def test_the_plan_mirrors_the_engine_constants():
    assert memory_plan.BLOCK_SIZE == kv.BLOCK_SIZE
    assert memory_plan.FUSED_MOE_MAX_TOKENS == fused_moe.MAX_TOKENS
    assert batch.bucket(257) == 512 and batch.bucket(1000) == 1024  # past 256: multiples of 256, a bounded set
    assert batch.buckets_upto(1024) == [*batch.BATCH_BUCKETS, 512, 768, 1024]
    assert batch.buckets_upto(1000) == [*batch.BATCH_BUCKETS, 512, 768] and batch.buckets_upto(3) == [1, 2]


def test_demo_engine_weights_and_kv_equal_the_real_allocations(engines_for):
    engines = engines_for(2)
    float32 = WeightFormat("float32", 4)
    split, sharded = (engine_plan(engines, d, float32, Storage(quant.QuantScheme())) for d in (1, 2))
    for g in split.gpus:
        assert g.group("weights") == tensor_bytes(engines / "target" / f"rank{g.gpu}.safetensors")
    assert split.gpus[0].group("drafter") == tensor_bytes(engines / "drafter" / "rank0.safetensors")
    assert split.gpus[1].group("drafter") == 0
    rank = RankRunner(engines, 0, 2, TPComm(0, 2), "cpu", placements=(1, 2))  # both placements: both drafter caches
    items = split.gpus[0].items
    assert items["KV cache, target (MLA latent)"][1] == rank.tcache.nbytes
    assert items["KV cache, drafter (TP1)"][1] == rank.slots[1][1].nbytes
    assert sharded.gpus[0].items["KV cache, drafter (shard)"][1] == rank.slots[2][1].nbytes
    shard = {id(t): t for t in rank.slots[2][0].w.values()}
    assert sharded.gpus[0].group("drafter") == sum(t.nbytes for t in shard.values())


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    return fixtures.make_fixtures(tmp_path_factory.mktemp("plan") / "fx", forms=("fp8", "k25", "drafter"))


@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_engine_weights_equal_the_rank_files(fx, tmp_path, tp):
    with contextlib.redirect_stdout(io.StringIO()):
        convert_pair(fx / "fp8", fx / "drafter", tmp_path / "ckpt", tp_size=tp)
        build_engines(tmp_path / "ckpt", tmp_path / "eng", dtype="fp8", max_batch_size=2, max_seq_len=256, progress=False)
    cfg, fmt, headers, _ = open_target(fx / "fp8", None)
    assert fmt.name == "fp8"
    for storage in (headers, Storage(headers.scheme)):  # read from the shards' headers, or from config.json alone
        plan = engine_plan(tmp_path / "eng", 1, fmt, storage)
        assert [g.group("weights") for g in plan.gpus] == \
               [tensor_bytes(tmp_path / "eng" / "target" / f"rank{r}.safetensors") for r in range(tp)]


def test_k25_headers_give_the_published_int4_bytes(fx):
    cfg, fmt, storage, source = open_target(fx / "k25", None)
    assert fmt.name == "int4" and "headers of 3 shards" in source
    plan = plan_memory(cfg, fmt, storage, None, Deployment(tp=1, max_batch_size=1, max_seq_len=64), on_gpu=False)
    r = CheckpointReader(fx / "k25")
    published = sum(r.info(n).nbytes for n in r.names() if ".experts." in n and not n.endswith("weight_shape"))
    assert plan.gpus[0].items["routed experts"][1] == published


def test_build_refuses_engines_over_the_budget_before_writing(fx, tmp_path):
    with contextlib.redirect_stdout(io.StringIO()):
        convert_pair(fx / "fp8", fx / "drafter", tmp_path / "ckpt", tp_size=1)
    with pytest.raises(MemoryPlanError, match=r"refusing to build: GPU 0 needs .* over its 0\.0 GiB budget"):
        build_engines(tmp_path / "ckpt", tmp_path / "eng", dtype="fp8", progress=False, gpu_memory_gib=0.01)
    assert not (tmp_path / "eng").exists()
    out = io.StringIO()  # a budget that fits: the plan line says which GPU of the deployment it is about
    with contextlib.redirect_stdout(out):
        build_engines(tmp_path / "ckpt", tmp_path / "eng", dtype="fp8", progress=False, gpu_memory_gib=64)
    assert re.search(r"memory plan: [\d.]+ GiB of 64\.00 GiB on the deployment's fullest GPU, its GPU 0 \(", out.getvalue())
