"""bench/lab/triton_trace.py: a request's latency split by step of the ensemble, from a trace file built by hand with
known times (checked part by part), clear errors on files that are not Triton's traces, and the split from a real
tritonserver's traces (bench/triton_share.py --trace on the demo engines)."""

from __future__ import annotations

import json
import math

import pytest

from splitspec.errors import SplitspecError

import triton_share
from lab.triton_trace import PATH_PARTS, TIMESTAMPS, load_traces, request_path

MS = 1_000_000  # ns


def _entries(tid: int, model: str, rid: str, parent: int | None, start_ms: float, end_ms: float) -> list[dict]:
    """Trace entries as Triton 2.51 writes them: the model's entry, then one entry per timestamp, spread evenly from
    ``start_ms`` to ``end_ms``."""
    head = {"id": tid, "model_name": model, "model_version": 1, "request_id": rid}
    if parent is not None:
        head["parent_id"] = parent
    step = (end_ms - start_ms) / (len(TIMESTAMPS) - 1)
    return [head] + [{"id": tid, "timestamps": [{"name": n, "ns": int((start_ms + i * step) * MS)}]}
                     for i, n in enumerate(TIMESTAMPS)]


def _request(rid: str, first_id: int, t0_ms: float, responses: int) -> list[dict]:
    """One streamed request sent at ``t0_ms``: ensemble at +0.5, preprocessing +0.6 … +1.4, spec_decode from +1.5
    (execute until +3.0), the engine from +2.0 for 100 ms, postprocessing of the responses, the last from +102.5 to
    +103.3; the client's final response at +103.6."""
    e = first_id
    out = _entries(e, "ensemble", rid, None, t0_ms + 0.5, t0_ms + 103.35)
    out += _entries(e + 1, "preprocessing", rid, e, t0_ms + 0.6, t0_ms + 1.4)
    out += _entries(e + 2, "spec_decode", rid, e, t0_ms + 1.5, t0_ms + 3.0)
    for i in range(responses):
        start = t0_ms + 102.5 - 10.0 * (responses - 1 - i)
        out += _entries(e + 3 + i, "postprocessing", rid, e, start, start + 0.8)
    return out


def test_request_path_splits_a_known_timeline(tmp_path):
    f = tmp_path / "trace.json"
    entries = _request("r-1", 10, 1000.0, responses=3) + _request("r-2", 20, 2000.0, responses=1)
    f.write_text(json.dumps(entries[::-1]))  # order in the file does not matter
    traces = load_traces(f)
    assert sorted(traces) == ["r-1", "r-2"]
    split = tmp_path / "split" / "trace.json"  # as Triton writes with log-frequency=1: one file per request
    split.parent.mkdir()
    (split.parent / "trace.json.10").write_text(json.dumps(_request("r-1", 10, 1000.0, responses=3)))
    (split.parent / "trace.json.9").write_text(json.dumps(_request("r-2", 20, 2000.0, responses=1)))
    (split.parent / "trace.json.notes").write_text("not a trace")
    assert sorted(load_traces(split)) == ["r-1", "r-2"]
    p = request_path(traces["r-1"], sent_ns=1000 * MS, latency_ms=103.6, engine_e2e_ms=100.0)
    want = {"grpc_in": 0.5, "preprocessing": 1.0, "spec_decode": 1.0, "engine": 100.0, "postprocessing": 0.8,
            "grpc_out": 0.3}
    for k, v in want.items():
        assert p[k] == pytest.approx(v, abs=1e-6), k
    assert math.fsum(p[k] for k in PATH_PARTS) == pytest.approx(103.6)
    assert p["responses"] == 3
    for k in ("preprocessing_execute", "first_postprocessing_execute", "last_postprocessing_execute"):
        assert p[k] == pytest.approx(0.8 / 6, abs=1e-5)  # COMPUTE_INPUT_END → COMPUTE_OUTPUT_START
    assert request_path(traces["r-2"], 2000 * MS, 103.6, 100.0)["responses"] == 1


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not JSON"),
    ('{"id": 1}', "expected a JSON list"),
    ('[{"model_name": "ensemble"}]', "entry 0: expected an object with an integer 'id'"),
    ('[{"id": 1, "timestamps": [{"name": "REQUEST_START", "ns": "soon"}]}]', "entry 0: expected timestamps"),
    ('[{"id": 1, "timestamps": null}]', "entry 0: 'timestamps' is NoneType, expected a list"),
    ('[{"id": 2, "model_name": "preprocessing", "parent_id": "1"}]', "entry 0: 'parent_id' = '1', expected an integer"),
    ('[{"id": 1, "model_name": "ensemble"}, {"id": 1, "model_name": "ensemble"}]', "entry 1: trace id 1 named twice"),
])
def test_load_traces_names_what_is_wrong(tmp_path, content, needle):
    f = tmp_path / "trace.json"
    f.write_text(content)
    with pytest.raises(SplitspecError, match=needle) as e:
        load_traces(f)
    assert str(f) in str(e.value)


def test_trace_files_of_one_run_only(tmp_path):
    d = tmp_path / "out [1]"  # glob's special characters in the folder's name
    d.mkdir()
    with pytest.raises(SplitspecError, match="no trace file"):
        load_traces(d / "trace.json")
    (d / "trace.json.2").write_text(json.dumps(_request("r-1", 10, 1000.0, responses=1)))
    for stray in ("trace.json.bak.3", "trace.json.\u00b2", "trace.json.", "other.json.4"):
        (d / stray).write_text("not a trace")
    assert sorted(load_traces(d / "trace.json")) == ["r-1"]
    (d / "trace.json.3").write_text(json.dumps(_request("r-1", 20, 5000.0, responses=1)))  # a second run's file
    with pytest.raises(SplitspecError, match="'r-1' traced twice"):
        load_traces(d / "trace.json")
    (d / "trace.json.3").write_text(json.dumps(_request("r-2", 10, 5000.0, responses=1)))  # ids restart per run
    with pytest.raises(SplitspecError, match="trace id 10 named twice"):
        load_traces(d / "trace.json")


def test_request_path_names_what_is_missing(tmp_path):
    f = tmp_path / "trace.json"
    f.write_text(json.dumps([e for e in _request("r", 1, 0.0, 2) if e["id"] != 3]))  # no spec_decode trace
    with pytest.raises(SplitspecError, match="'r': no trace of its spec_decode step"):
        request_path(load_traces(f)["r"], 0, 103.6, 100.0)
    f.write_text(json.dumps([e for e in _request("r", 1, 0.0, 2)
                             if not (e["id"] == 2 and e.get("timestamps", [{}])[0].get("name") == "COMPUTE_INPUT_END")]))
    with pytest.raises(SplitspecError, match="trace of preprocessing .request 'r'.: no COMPUTE_INPUT_END timestamp"):
        request_path(load_traces(f)["r"], 0, 103.6, 100.0)
    f.write_text(json.dumps(_request("r", 1, 0.0, 2)))
    with pytest.raises(SplitspecError, match="the engine's e2e time is None"):
        request_path(load_traces(f)["r"], 0, 103.6, None)


@pytest.mark.server
@pytest.mark.slow
def test_triton_share_trace_on_a_real_server(built_engines, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "def fibonacci(n):"}\n'
                       '{"id": "b", "prompt": "How do I read a file line by line?", "chat": true}\n')
    out = tmp_path / "out"
    assert triton_share.main(["--engines", str(built_engines), "--max-tokens", "8", "--rounds", "1", "--loads", "2", "--trace",
                     "-k", "2", "--prompts", str(prompts), "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    # each load's server traced into a folder of its own (trace ids restart with each server)
    for load in (1, 2):
        assert list((out / "trace" / f"load-{load}").glob("trace.json.*"))
    assert [r["load"] for r in result["served"]] == [0, 0, 1, 1]
    assert [x["load"] for x in result["summary"]["loads"]] == [0, 1]
    assert all(x["outputs_differing"] == 0 for x in result["summary"]["loads"])
    for r in result["served"]:
        p = r["path_ms"]
        assert math.fsum(p[k] for k in PATH_PARTS) == pytest.approx(r["wall_ms"], abs=1e-3)
        assert p["responses"] >= r["responses"] >= 1  # postprocessing ran once per response; the client got them
        # Triton's times and the client's on one clock: every part that Triton bounds at both ends before the final
        # response leaves lies inside the request's latency, the path in before the client's first tokens
        for k in ("grpc_in", "preprocessing", "spec_decode"):
            assert 0 < p[k] < r["wall_ms"] - p["engine"], (k, p)
        assert p["grpc_in"] + p["preprocessing"] < r["ttft_ms"]
        # Triton records the last step's REQUEST_END after its response has left, so the last postprocessing can
        # outlast the client's wait and gRPC out come out negative (−0.9 ms, and −5.1 ms with postprocessing at
        # 6.1 ms, seen on a busy 2-core machine); but the client cannot have the final response before that step
        # started
        assert p["postprocessing"] > 0, p
        assert 0 < p["postprocessing"] + p["grpc_out"] < r["wall_ms"] - p["engine"]
    mean = result["summary"]["served_path_ms_per_request"]
    assert set(PATH_PARTS) <= set(mean)
