"""Load-test tooling: prompt files, perf_analyzer / genai-perf command lines and reports, the benchmark's
aggregation — and seconds-long passes of perf_analyzer (gRPC streaming and HTTP), genai-perf and the
benchmark client against a real server, so CI proves the tools still work with the ensemble."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import pytest

from splitspec.cli_parser import levels
from splitspec.measure.placement_bench import aggregate, measure_placement, request_blocks
from splitspec.measure.placement_report import summary_markdown
from splitspec.measure.stream_client import PlacementRun, RequestRecord
from splitspec.errors import ConfigError
from splitspec.measure.perf_levels import parse_genai_perf, read_perf_csv, run_genai_perf_level, run_perf_analyzer_level
from splitspec.measure.perf_tools import find_genai_perf, genai_perf_command, perf_command
from splitspec.measure.prompts import Prompt, read_prompts, rendered_text, write_genai_perf_input, write_input_data
from splitspec.serving.repo import repo_setting

MAX_TOKENS = 8
EVAL_PROMPTS = Path(__file__).resolve().parents[2] / "eval" / "prompts.jsonl"


# ---------------------------------------------------------------------------------------------
# Without a server
# ---------------------------------------------------------------------------------------------


def test_read_prompts_formats_and_errors(tmp_path, built_engines):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join([
        json.dumps({"id": "a", "prompt": "def f(x):"}),
        "",
        json.dumps({"id": "b", "prompt": "Explain lists.", "chat": True}),
        json.dumps({"id": "c", "messages": [{"role": "user", "content": "Hi?"}]}),
        json.dumps({"id": "d", "messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi?"}]}),
        "plain \\u2192 text",
    ]) + "\n")
    ps = read_prompts(f, built_engines / "target")
    assert [(p.id, p.chat) for p in ps] == [("a", False), ("b", True), ("c", True), ("d", False), ("line-6", False)]
    assert ps[4].text == "plain → text"
    assert ps[2].text == "Hi?"
    assert "Be brief." in ps[3].text and ps[3].text.endswith("<|im_middle|>")
    # chat prompts rendered for genai-perf are exactly the text the server's chat template makes
    rendered = rendered_text(ps, built_engines / "target")
    assert rendered[0] == "def f(x):" and rendered[2].count("Hi?") == 1 and "<|im_user|>" in rendered[2]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        read_prompts(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1: not valid JSON"):
        read_prompts(bad)
    with pytest.raises(ConfigError, match="not found"):
        read_prompts(tmp_path / "missing.jsonl")
    multi = tmp_path / "multi.jsonl"
    multi.write_text(json.dumps({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]}) + "\n")
    with pytest.raises(ConfigError, match="tokenizer"):
        read_prompts(multi)


def test_eval_prompts_load():
    if not EVAL_PROMPTS.is_file():
        pytest.skip(f"{EVAL_PROMPTS} is not there")
    ps = read_prompts(EVAL_PROMPTS)
    assert len(ps) >= 5 and all(p.text for p in ps)
    assert [p.id for p in read_prompts(None)][:2] == ["builtin-1", "builtin-2"]  # no file: the built-in prompts


def test_input_files_for_both_protocols(tmp_path):
    ps = [Prompt("a", "def f():"), Prompt("b", "Hello?", True)]
    g = json.loads(write_input_data(tmp_path / "g.json", ps, 16, "grpc").read_text())["data"]
    assert g[1] == {"text_input": ["Hello?"], "max_tokens": [16], "apply_chat_template": [True], "stream": [True]}
    h = json.loads(write_input_data(tmp_path / "h.json", ps, 16, "http").read_text())["data"]
    assert h[0] == {"payload": [{"text_input": "def f():", "max_tokens": 16, "apply_chat_template": False, "stream": True}]}
    with pytest.raises(ConfigError, match="protocol"):
        write_input_data(tmp_path / "x.json", ps, 16, "udp")


def test_command_lines(tmp_path):
    g = perf_command(Path("pa"), "127.0.0.1:1", tmp_path / "in.json", tmp_path / "o.csv", 3.0, 4, 4, request_count=9)
    assert g[g.index("-i") + 1] == "grpc" and "--streaming" in g and g[g.index("--measurement-request-count") + 1] == "9"
    assert g[g.index("-f") + 1] == str(tmp_path / "o.csv")
    h = perf_command(Path("pa"), "", tmp_path / "in.json", tmp_path / "o.csv", 3.0, 1, protocol="http",
                     http_address="127.0.0.1:2", warmup_requests=1)
    assert h[h.index("--service-kind") + 1] == "openai" and h[h.index("--endpoint") + 1] == "v2/models/ensemble/generate_stream"
    assert "--streaming" not in h and h[h.index("--warmup-request-count") + 1] == "1"
    gp = genai_perf_command(Path("gp"), "127.0.0.1:2", tmp_path / "in.jsonl", tmp_path / "a", tmp_path / "tok", 2, 6, 16,
                            extra_inputs={"num_draft_tokens": 0})
    assert gp[gp.index("--endpoint-type") + 1] == "generate" and "--streaming" in gp
    assert gp[gp.index("--extra-inputs") + 1] == "num_draft_tokens:0"
    oa = genai_perf_command(Path("gp"), "127.0.0.1:3", tmp_path / "in.jsonl", tmp_path / "a", tmp_path / "tok", 2, 6, 16,
                            openai_model="demo")
    assert oa[oa.index("-m") + 1] == "demo" and oa[oa.index("--endpoint-type") + 1] == "chat" and "--streaming" in oa
    assert oa[oa.index("-u") + 1] == "127.0.0.1:3" and "--endpoint" not in oa  # genai-perf's default: v1/chat/completions
    assert oa[oa.index("--output-tokens-mean") + 1] == "16"  # sent as max_tokens
    for bad in ("1,x", "0", "257", "", "1,,2"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated integers"):
            levels(bad)
    assert levels("8,1,2,2") == [8, 1, 2] and levels(" 4 ") == [4]


def test_parse_genai_perf(tmp_path):
    f = tmp_path / "profile_export_genai_perf.json"
    f.write_text(json.dumps({"time_to_first_token": {"unit": "ms", "avg": 40.5, "p50": 39.0, "p90": 50, "p99": 60},
                             "output_token_throughput": {"unit": "tokens/sec", "avg": 25.25},
                             "request_throughput": {"unit": "requests/sec", "avg": 0.8}}))
    m = parse_genai_perf(f)
    assert m["ttft_ms_avg"] == 40.5 and m["ttft_ms_p50"] == 39.0 and m["output_tokens_per_s_avg"] == 25.25
    assert m["requests_per_s_avg"] == 0.8


def _rec(k, c, pid, n, acc, pos, latency, sha="s", draft_tp=1):
    return RequestRecord(draft_tp=draft_tp, k=k, concurrency=c, prompt_id=pid, block=0, latency_ms=latency, ttft_ms=10.0,
                         token_times_ms=[(10.0, 1), (latency, n - 1)], num_output_tokens=n, acceptance_length=acc,
                         accepted_per_position=pos, draft_ms=2.0 * ((n - 1) / acc) * (k > 0), verify_ms=10.0 * ((n - 1) / acc),
                         engine_ttft_ms=9.0, engine_e2e_ms=latency - 1, queue_ms=0.1, finish_reason="length", output_sha=sha)


def test_aggregate_ratios_acceptance_and_summary():
    run1 = PlacementRun(1, [0, 2])
    run1.records = [_rec(0, 1, "a", 21, 1.0, [], 1000.0), _rec(0, 1, "b", 21, 1.0, [], 1000.0),
                    # 20 emitted tokens in 10 cycles: acceptance length 2, draft position 1 accepted in 8 cycles, 2 in 2
                    _rec(2, 1, "a", 21, 2.0, [8, 2], 500.0), _rec(2, 1, "b", 21, 2.0, [8, 2], 500.0, sha="other")]
    run1.wall_s = {(0, 1): 2.0, (2, 1): 1.0}
    run2 = PlacementRun(2, [0, 2])
    # its own no-speculation requests ran slower (another load): the ratio is to them
    run2.records = [_rec(0, 1, "a", 21, 1.0, [], 1600.0, draft_tp=2), _rec(2, 1, "a", 21, 2.0, [8, 2], 800.0, draft_tp=2)]
    run2.wall_s = {(0, 1): 1.6, (2, 1): 0.8}
    rows = {(r["draft_tp"], r["k"]): r for r in aggregate([run1, run2])}
    base, spec, shard = rows[(1, 0)], rows[(1, 2)], rows[(2, 2)]
    assert rows[(2, 0)]["configuration"] == "no speculation (beside drafter TP2)"
    assert base["configuration"] == "no speculation" and base["acceptance_length"] == 1.0
    assert base["tokens_per_s_per_user"] == pytest.approx(21.0) and base["tokens_per_s"] == pytest.approx(21.0)
    assert spec["acceptance_length"] == pytest.approx(2.0)
    assert spec["acceptance_by_position"] == pytest.approx([0.8, 0.2])
    assert spec["ratio_per_user"] == pytest.approx(2.0) and spec["ratio_aggregate"] == pytest.approx(2.0)
    assert spec["draft_ms_per_cycle"] == pytest.approx(2.0) and spec["verify_ms_per_cycle"] == pytest.approx(10.0)
    assert spec["outputs_differing_from_no_speculation"] == 1
    assert shard["configuration"] == "EAGLE-3, drafter TP2" and shard["ratio_per_user"] == pytest.approx(2.0)
    run2.records, run2.wall_s = run2.records[1:], {(2, 1): 0.8}  # no baseline of its own: the first server's
    assert {r["k"]: r["ratio_per_user"] for r in aggregate([run1, run2]) if r["draft_tp"] == 2} == {2: pytest.approx(1.25)}
    md = summary_markdown({"date": "d", "engines": {}}, list(rows.values()))
    assert "| no speculation | 0 | 21.0 | 1.00 |" in md and "| EAGLE-3, drafter TP1 | 2 | 42.0 | 2.00 |" in md
    assert "Greedy outputs differing from no speculation (same prompt and concurrency): 1." in md


def test_blocks_cycle_prompts():
    ps = [Prompt(str(i), f"p{i}") for i in range(3)]
    assert [[p.id for p in b] for b in request_blocks(ps, 4, 2)] == [["0", "1"], ["2", "0"]]
    assert [[p.id for p in b] for b in request_blocks(ps, 3, 2)] == [["0", "1"], ["2", "0"]]  # filled up to the concurrency


# ---------------------------------------------------------------------------------------------
# Against a served repository
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def perf_server(shared_server):
    """The session's shared server (tests/conftest.py): the tools need a running ensemble, not a deployment of
    their own."""
    return shared_server.get()


@pytest.fixture(scope="module")
def short_prompts():
    return [Prompt("code", "def fibonacci(n):"), Prompt("chat", "How do I read a file line by line in Python?", True)]


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_perf_analyzer_pass(perf_server, short_prompts, tmp_path, protocol):
    data = write_input_data(tmp_path / f"in_{protocol}.json", short_prompts, MAX_TOKENS, protocol)
    t0 = time.monotonic()
    r = run_perf_analyzer_level(protocol, 2, data, tmp_path / "pa", grpc_address=perf_server.grpc_address,
                                http_address=f"127.0.0.1:{perf_server.http_port}", seconds=1.0, request_count=2,
                                timeout_s=90)
    assert r.error is None, (r.error, (tmp_path / "pa" / f"{protocol}_c2.log").read_text()[-3000:])
    assert time.monotonic() - t0 < 90
    assert r.metrics["requests_per_s"] > 0 and r.metrics["latency_p50_ms"] > 0
    rows = read_perf_csv(tmp_path / "pa" / f"{protocol}_c2.csv")
    assert len(rows) == 1 and rows[0]["Concurrency"] == "2" and float(rows[0]["Inferences/Second"]) > 0


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["generate_stream", "openai"])
def test_genai_perf_pass(perf_server, short_prompts, tmp_path, endpoint):
    """genai-perf against Triton's generate_stream, and against the OpenAI front end (streamed chat completions)."""
    from splitspec.serving.openai_api import OpenAIServer

    binary = find_genai_perf()
    if binary is None:
        pytest.skip("genai-perf is not installed (the 'perf' extra: make perf-tools, or pip install -e '.[perf]')")
    tokenizer_dir = Path(repo_setting(perf_server.repo, "preprocessing", "tokenizer_dir"))
    openai = endpoint == "openai"
    inp = write_genai_perf_input(tmp_path / "in.jsonl", short_prompts, tokenizer_dir, chat_endpoint=openai)
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        api = stack.enter_context(OpenAIServer(perf_server.repo, perf_server.grpc_address, 0, "127.0.0.1")) if openai else None
        r = run_genai_perf_level(1, inp, tmp_path / "gp", http_address=f"127.0.0.1:{api.port if api else perf_server.http_port}",
                                 tokenizer_dir=tokenizer_dir, max_tokens=MAX_TOKENS, request_count=2, timeout_s=90,
                                 binary=binary, openai_model=api.model.name if api else None)
    log = tmp_path / "gp" / f"{'openai_' if openai else ''}c1" / "genai_perf.log"
    assert r.error is None, (r.error, log.read_text()[-3000:])
    assert r.protocol == ("openai" if openai else "http")
    assert time.monotonic() - t0 < 90
    m = r.metrics
    assert m["requests_avg"] == 2
    assert m["ttft_ms_avg"] > 0 and m["itl_ms_avg"] > 0 and m["output_tokens_per_s_avg"] > 0
    assert m["latency_ms_p50"] >= m["ttft_ms_p50"]


@pytest.mark.server
@pytest.mark.slow
def test_bench_client_measures_each_k(perf_server, short_prompts):
    run = measure_placement(perf_server, 1, [0, 2], short_prompts, [1, 2], MAX_TOKENS, 2, timeout_s=60,
                            log=lambda s: None)
    assert {(r.k, r.concurrency) for r in run.records} == {(0, 1), (2, 1), (0, 2), (2, 2)}
    assert len(run.records) == 8  # 2 requests per (k, concurrency); plus nothing from the warm-up
    for r in run.records:
        assert r.num_output_tokens >= 1 and r.latency_ms > 0 and r.ttft_ms is not None and r.ttft_ms <= r.latency_ms
        assert sum(n for _, n in r.token_times_ms) == r.num_output_tokens
        assert len(r.accepted_per_position) == r.k and r.acceptance_length >= 1.0
    rows = aggregate([run])
    assert all(r["outputs_differing_from_no_speculation"] == 0 for r in rows)  # greedy speculation is lossless
    assert {r["k"]: r["verify_ms_per_cycle"] > 0 for r in rows} == {0: True, 2: True}
    assert run.metrics_delta.get("splitspec_cycles_total", 0) > 0


def test_perf_markdown_tables():
    from splitspec.measure.perf_levels import LevelResult
    from splitspec.measure.perf_suite import perf_markdown

    rows = [LevelResult("perf_analyzer", "grpc", 4, 5.0, {"requests_per_s": 2.0, "responses_per_s": 20.0, "latency_avg_ms": 900.0,
                                                           "latency_p50_ms": 880.0, "latency_p90_ms": 950.0,
                                                           "latency_p95_ms": 990.0, "latency_p99_ms": 1000.0}),
            LevelResult("perf_analyzer", "http", 64, 300.0, {}, "timed out after 300 s (killed)"),
            LevelResult("genai-perf", "http", 1, 9.0, {"output_tokens_per_s_avg": 30.0, "ttft_ms_p50": 40.0, "itl_ms_p50": 30.5})]
    md = perf_markdown({"max_tokens": 32, "date": "today"}, rows)
    assert "| grpc | 4 | 2.00 | 64 | 10.0 | 880 | 950 | 990 | 1000 | 900 |" in md
    assert "| http | 64 | failed: timed out after 300 s (killed) |" in md
    assert "| generate_stream | 1 | 30.0 | — | — | 40 / — | 30.5 / — | — |" in md


@pytest.mark.server
@pytest.mark.slow
def test_perf_suite_writes_its_results(perf_server, tmp_path, capsys):
    from splitspec.measure.perf_suite import run_perf_suite

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "def fibonacci(n):"}) + "\n")
    out = run_perf_suite(server=perf_server, out_dir=tmp_path / "res", concurrencies=[1], protocols=["grpc"],
                         max_tokens=MAX_TOKENS, prompts_path=prompts, seconds=1.0, llm_metrics=False, level_timeout_s=90)
    summary = json.loads((out / "summary.json").read_text())
    assert [(lv["tool"], lv["protocol"], lv["concurrency"], lv["error"]) for lv in summary["levels"]] == [
        ("perf_analyzer", "grpc", 1, None)]
    assert summary["meta"]["cpu_count"] and summary["meta"]["versions"]["tritonclient"] == "2.50.0"
    assert (out / "perf_analyzer_grpc.csv").read_text().startswith("Concurrency,Inferences/Second")
    assert "| grpc | 1 |" in (out / "summary.md").read_text()
    assert perf_server.is_running()  # a server passed in is left running
    assert "[1/1] perf_analyzer grpc concurrency 1" in capsys.readouterr().out
