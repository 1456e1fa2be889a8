"""Serving through a real tritonserver: streaming, concurrency, cancellation, metrics, errors, worker crash.

The session's shared server (tests/conftest.py: target TP2 + TP1 drafter on CPU, continuous batching up to 64
sequences) on free ports; the crash test runs last, kills a target worker, and restarts the server. References come
from the engine in this process (target-only greedy decoding, so they do not depend on the drafter) and
from the tokenizer (``decode`` of all output ids), so streamed text is checked against an independent
detokenisation.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from splitspec.serving.client import ask_grpc, ask_http, merge, stream_grpc, stream_http
from splitspec.errors import SplitspecError
from splitspec.serving.metrics import metric_value, parse_prometheus
from splitspec.serving.process_tree import pipeline_processes
from splitspec.serving.repo import render_repo
from splitspec.serving.server_log import EXIT_GAVE_UP
from splitspec.serving.tritonserver import TritonServer
from splitspec.settings import ServeConfig

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

K = 4
MAX_BATCH = 64
MAX_TOKENS = 20
CLOSE = {"Connection": "close"}
#: Prompts of the byte-for-byte test: code, non-ASCII text (multi-byte UTF-8), a single character.
PROMPTS = ["def fibonacci(n):", "naïve café — 日本語 ", "import os\n", "Ünïcödé ✓ → ", "x",
           "class Stack:\n    def push(self, item):"]
KS = [0, 1, 3, 4]
SEEDS = [1, 2, 3]
SAMPLING = {"temperature": 0.9, "top_p": 0.95, "top_k": 50}
#: 64 distinct prompts for the concurrency test.
MANY = [f"{head}{i}" for i in range(8) for head in
        ("def f", "x = ", "class C", "import m", "# note ", "for i in range(", "print(", "return ")]
LONG_PROMPT = "def fibonacci(n):"


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(built_engines):
    from splitspec.runtime.tokenizer import ChatTokenizer

    return ChatTokenizer.from_dir(built_engines / "target")


@pytest.fixture(scope="module")
def reference(built_engines, tok):
    """Output ids per (prompt, max_tokens) from the engine in this process: target-only greedy
    (k = 0), and seeded sampling with k = K, in one engine load (every request names its k). Computed before the
    server starts (2 cores)."""
    from splitspec.runtime.scheduler import SpeculativeEngine
    from splitspec.runtime.types import Request
    from splitspec.runtime.sampling import SamplingParams

    greedy = [(p, MAX_TOKENS) for p in PROMPTS + MANY] + [(LONG_PROMPT, 120)]
    reqs = [Request(tok.encode(p), n, num_draft_tokens=0) for p, n in greedy]
    reqs += [Request(tok.encode(PROMPTS[0]), MAX_TOKENS, SamplingParams(seed=s, **SAMPLING), K) for s in SEEDS]
    with SpeculativeEngine.load(ServeConfig(built_engines, num_draft_tokens=0, max_batch_size=MAX_BATCH,
                                            kv_tokens=MAX_BATCH * 80)) as eng:
        results = eng.run(reqs)
    out: dict = {key: res.token_ids for key, res in zip(greedy, results)}
    out.update({("sampled", s): res.token_ids for s, res in zip(SEEDS, results[len(greedy):])})
    return out


@pytest.fixture(scope="module")
def served(shared_server):
    """The session's shared server (tests/conftest.py), with this module's deployment."""
    assert (shared_server.num_draft_tokens, shared_server.max_batch_size, shared_server.kv_tokens) == (K, MAX_BATCH, MAX_BATCH * 80)
    return shared_server


@pytest.fixture
def srv(served, reference):
    """The running server (started after the reference, if a test before stopped it)."""
    return served.get()


def scrape(srv) -> dict:
    r = requests.get(srv.metrics_url, headers=CLOSE, timeout=10)
    assert r.status_code == 200
    return parse_prometheus(r.text)


def wait_for(cond, timeout_s: float, what: str, poll_s: float = 0.05):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        v = cond()
        if v:
            return v
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _live_in_group(pgid: int) -> list[str]:
    """Command names of the processes of process group ``pgid`` that still run (zombies, which hold nothing but their
    pid until something reaps them, left out), from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
        except (OSError, ValueError):
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if rest[2] == str(pgid) and rest[0] != "Z":  # fields 3 (state) and 5 (pgrp) of proc(5)
            out.append(name)
    return out


# ---------------------------------------------------------------------------------------------
# Streaming equals non-streaming, byte for byte
# ---------------------------------------------------------------------------------------------


def test_stream_equals_non_stream_byte_for_byte(srv, tok, reference):
    """For every prompt and k: HTTP generate (one response), HTTP generate_stream (SSE) and gRPC
    stream_infer give the same UTF-8 bytes, equal to the tokenizer's decode of the reference ids;
    the streamed ids concatenate to the reference. Seeded sampling is reproducible across protocols."""
    jobs = {}
    with cf.ThreadPoolExecutor(max_workers=48) as pool:
        for p in PROMPTS:
            for k in KS:
                kw = dict(num_draft_tokens=k, return_token_ids=True)
                jobs[(p, k, "http")] = pool.submit(ask_http, srv.generate_url, p, MAX_TOKENS, **kw)
                jobs[(p, k, "sse")] = pool.submit(lambda *a, **b: list(stream_http(*a, **b)),
                                                  srv.generate_stream_url, p, MAX_TOKENS, **kw)
                jobs[(p, k, "grpc")] = pool.submit(lambda *a, **b: list(stream_grpc(*a, **b)),
                                                   srv.grpc_address, p, MAX_TOKENS, **kw)
        for s in SEEDS:
            kw = dict(seed=s, return_token_ids=True, **SAMPLING)
            jobs[("sampled", s, "http")] = pool.submit(ask_http, srv.generate_url, PROMPTS[0], MAX_TOKENS, **kw)
            jobs[("sampled", s, "grpc")] = pool.submit(lambda *a, **b: list(stream_grpc(*a, **b)),
                                                       srv.grpc_address, PROMPTS[0], MAX_TOKENS, **kw)
        results = {key: f.result() for key, f in jobs.items()}

    for p in PROMPTS:
        ref_ids = reference[(p, MAX_TOKENS)]
        ref_text = tok.decode(ref_ids)
        for k in KS:
            full = results[(p, k, "http")]
            assert full["output_ids"] == ref_ids, (p, k)
            assert full["text_output"].encode() == ref_text.encode(), (p, k)
            for proto in ("sse", "grpc"):
                events = results[(p, k, proto)]
                merged = merge(events)
                assert merged["text_output"].encode() == ref_text.encode(), (p, k, proto, [e.get("text_output") for e in events])
                assert merged["output_ids"] == ref_ids, (p, k, proto)
                assert merged["finish_reason"] == full["finish_reason"]
                assert merged["num_responses"] > 1, "streaming sends one response per cycle"
                # every chunk's text is exactly the decode of the ids so far minus what came before
                seen: list[int] = []
                sent = ""
                for e in events:
                    seen += e.get("output_ids", [])
                    sent += e.get("text_output", "")
                    assert tok.decode(seen).startswith(sent), (p, k, proto)
    for s in SEEDS:
        ref_ids = reference[("sampled", s)]
        assert results[("sampled", s, "http")]["output_ids"] == ref_ids, s
        g = merge(results[("sampled", s, "grpc")])
        assert g["output_ids"] == ref_ids and g["text_output"] == tok.decode(ref_ids), s
    assert len({tuple(reference[("sampled", s)]) for s in SEEDS}) > 1, "different seeds should sample differently"


def test_outputs_on_request_and_stop_strings(srv, tok, reference):
    p = PROMPTS[0]
    ref_text = tok.decode(reference[(p, MAX_TOKENS)])
    plain = ask_http(srv.generate_url, p, MAX_TOKENS)
    assert plain["text_output"] == ref_text and plain["finish_reason"] in ("length", "stop")
    assert "output_ids" not in plain and "acceptance_length" not in plain
    full = ask_http(srv.generate_url, p, MAX_TOKENS, return_stats=True, num_draft_tokens=3)
    assert len(full["accepted_per_position"]) == 3
    assert full["acceptance_length"] >= 1.0
    assert full["num_output_tokens"] == len(reference[(p, MAX_TOKENS)])
    assert full["num_input_tokens"] == len(tok.encode(p))
    assert full["e2e_ms"] >= full["ttft_ms"] >= full["queue_ms"] >= 0 and full["verify_ms"] > 0
    # a stop string taken from the middle of the answer: the text ends right before it
    at = next(i for i in range(5, len(ref_text) - 3) if "\ufffd" not in ref_text[i:i + 3] and ref_text[i:i + 3].strip())
    stop = ref_text[at:at + 3]
    cut = ref_text.index(stop)
    for answer in (ask_http(srv.generate_url, p, MAX_TOKENS, stop=[stop]),
                   ask_grpc(srv.grpc_address, p, MAX_TOKENS, stop=[stop], stream=True)):
        assert answer["text_output"] == ref_text[:cut]
        assert answer["finish_reason"] == "stop"


# ---------------------------------------------------------------------------------------------
# Concurrency
# ---------------------------------------------------------------------------------------------


def test_64_concurrent_streams(srv, tok, reference):
    """64 streams at once (half HTTP SSE, half gRPC) all complete with the reference output; the
    engine decoded more than 32 of them in one cycle. Eight tokens each: every cycle verifies 64 × (k + 1)
    tokens, and the first cycles hold all 64 streams whatever their length; greedy decoding's first eight tokens
    are the reference's first eight."""
    before = scrape(srv)
    n = 8

    def run(i, p):
        if i % 2:
            return merge(stream_grpc(srv.grpc_address, p, n, return_token_ids=True))
        return merge(stream_http(srv.generate_stream_url, p, n, return_token_ids=True))

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(max_workers=len(MANY)) as pool:
        answers = list(pool.map(run, range(len(MANY)), MANY))
    wall = time.monotonic() - t0
    for p, a in zip(MANY, answers):
        assert a["output_ids"] == reference[(p, MAX_TOKENS)][:n], p
        assert a["text_output"] == tok.decode(reference[(p, MAX_TOKENS)][:n]), p
    after = scrape(srv)
    name = "splitspec_cycle_decode_sequences"
    cycles = metric_value(after, f"{name}_count") - metric_value(before, f"{name}_count")
    small = metric_value(after, f"{name}_bucket", le="32") - metric_value(before, f"{name}_bucket", le="32")
    assert cycles > small, "no cycle decoded more than 32 sequences at once"
    print(f"\n64 streams x {n} tokens in {wall:.1f} s ({64 * n / wall:.0f} tokens/s)")


# ---------------------------------------------------------------------------------------------
# Cancellation
# ---------------------------------------------------------------------------------------------


def settled_scrape(srv, timeout_s: float = 20.0):
    """Metrics once nothing is running and the exported counters have stopped moving (they are
    exported every 0.2 s, so an earlier test's last cancellation can still be on its way)."""
    deadline = time.monotonic() + timeout_s
    prev = None
    while time.monotonic() < deadline:
        m = scrape(srv)
        key = (metric_value(m, "splitspec_active_sequences"), metric_value(m, "splitspec_requests_total", finish_reason="cancelled"))
        if key[0] == 0 and key == prev:
            return m
        prev = key
        time.sleep(0.5)
    raise AssertionError("metrics did not settle")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cancel_frees_slot_and_kv_while_others_stream(srv, tok, reference, protocol):
    """A stream whose client cancels (gRPC) or disconnects (HTTP) leaves the batch and frees its KV
    blocks within a few cycles; a concurrent stream completes with the reference output."""
    other: dict = {}

    def run_other():
        other["answer"] = merge(stream_grpc(srv.grpc_address, LONG_PROMPT, 120, return_token_ids=True))

    before = settled_scrape(srv)
    t = threading.Thread(target=run_other)
    t.start()
    wait_for(lambda: metric_value(scrape(srv), "splitspec_active_sequences") == 1, 20, "the other stream to start")
    start = stream_grpc if protocol == "grpc" else stream_http
    addr = srv.grpc_address if protocol == "grpc" else srv.generate_stream_url
    victim = start(addr, LONG_PROMPT, 200)
    for i, _ in enumerate(victim):
        if i == 2:
            break
    m = wait_for(lambda: (lambda m: m if metric_value(m, "splitspec_active_sequences") == 2 else None)(scrape(srv)),
                 10, "both streams in the batch (metrics are exported every 0.2 s)")
    kv_both = metric_value(m, "splitspec_kv_used_blocks")
    cycles0 = metric_value(m, "splitspec_cycles_total")
    t0 = time.monotonic()
    victim.close()  # gRPC: cancels the stream; HTTP: drops the connection
    m = wait_for(lambda: (lambda m: m if metric_value(m, "splitspec_active_sequences") == 1 else None)(scrape(srv)),
                 10, "the cancelled stream to leave the batch")
    freed_s = time.monotonic() - t0
    assert metric_value(m, "splitspec_kv_used_blocks") < kv_both
    # the finish is counted by the reader thread, which may publish it one export (0.2 s) after the slot is freed
    cancelled = lambda m: (metric_value(m, "splitspec_requests_total", finish_reason="cancelled")  # noqa: E731
                           - metric_value(before, "splitspec_requests_total", finish_reason="cancelled"))
    m2 = wait_for(lambda: (lambda m: m if cancelled(m) >= 1 else None)(scrape(srv)), 10, "the cancellation to be counted")
    assert cancelled(m2) == 1
    print(f"\n{protocol}: slot freed {freed_s * 1000:.0f} ms after the client cancelled "
          f"(<= {metric_value(m, 'splitspec_cycles_total') - cycles0:.0f} cycles, metrics exported every 0.2 s)")
    t.join(60)
    assert other["answer"]["output_ids"] == reference[(LONG_PROMPT, 120)]
    wait_for(lambda: metric_value(scrape(srv), "splitspec_kv_used_blocks") == 0, 10, "all KV blocks to be free")


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

HTTP_BAD = [
    # (body, HTTP status, text expected in the error)
    ({"max_tokens": 8}, 400, "text_input"),
    ({"text_input": "", "max_tokens": 8}, 400, "empty prompt"),
    ({"text_input": "x", "max_tokens": -1}, 400, "max_tokens = -1"),
    ({"text_input": "x", "max_tokens": 0}, 400, "max_tokens = 0"),
    ({"text_input": "x", "max_tokens": 100000}, 400, "max_tokens = 100000"),
    ({"text_input": "x", "max_tokens": 260}, 400, "max_seq_len"),
    ({"text_input": "x " * 400, "max_tokens": 8}, 400, "max_seq_len"),
    ({"text_input": "x", "max_tokens": 8, "temperature": -0.5}, 400, "temperature"),
    ({"text_input": "x", "max_tokens": 8, "top_p": 0}, 400, "top_p"),
    ({"text_input": "x", "max_tokens": 8, "top_k": -3}, 400, "top_k"),
    ({"text_input": "x", "max_tokens": 8, "num_draft_tokens": 999}, 400, "num_draft_tokens"),
    ({"text_input": "x", "max_tokens": 8, "stop": [""]}, 400, "stop"),
    ({"text_input": "x", "max_tokens": 8, "max_new_tokens": 5}, 400, "unknown parameter 'max_new_tokens'"),
    # Triton's own HTTP front end rejects JSON it cannot convert with status 500; the HTTP guard answers that (a
    # value of the wrong type, the string-list inputs' form, JSON that does not parse) with 400 before it
    ({"text_input": "x", "max_tokens": "ten"}, 400, "max_tokens: expected an integer (INT32), got a string"),
    ({"text_input": "x", "max_tokens": 8, "temperature": "hot"}, 400, "temperature: expected a number (FP32)"),
    ({"text_input": "x", "max_tokens": 8, "stop": 5}, 400, "stop: expected a string or an array of strings"),
    ("{not json", 400, "not valid JSON"),
]


def test_bad_requests_get_clear_errors_while_a_stream_continues(srv, tok, reference):
    """Each malformed request is answered with its error; a stream running meanwhile is not disturbed."""
    stream: dict = {}

    def run_stream():
        try:
            stream["answer"] = merge(stream_grpc(srv.grpc_address, LONG_PROMPT, 120, return_token_ids=True))
        except Exception as e:  # reported by the assertion below
            stream["error"] = e

    t = threading.Thread(target=run_stream)
    t.start()
    wait_for(lambda: metric_value(scrape(srv), "splitspec_active_sequences") >= 1, 20, "the stream to start")
    for body, status, needle in HTTP_BAD:
        for url in (srv.generate_url, srv.generate_stream_url):
            kw = {"data": body} if isinstance(body, str) else {"json": body}
            r = requests.post(url, headers=CLOSE, timeout=60, **kw)
            text = r.text
            if url == srv.generate_stream_url and r.status_code == 200:  # an error event in the stream
                assert text.startswith("data: "), text
            else:
                assert r.status_code == status, (body, r.status_code, text)
            assert needle in text, (body, text)
    # gRPC: wrong datatype and unknown input are refused by Triton, the rest by the models
    import numpy as np
    import tritonclient.grpc as grpcclient

    from splitspec.serving.client import grpc_inputs
    bad_type = grpcclient.InferInput("max_tokens", [1, 1], "FP32")
    bad_type.set_data_from_numpy(np.array([[8.0]], dtype=np.float32))
    unknown = grpcclient.InferInput("max_new_tokens", [1, 1], "INT32")
    unknown.set_data_from_numpy(np.array([[8]], dtype=np.int32))
    unbatched = grpcclient.InferInput("max_tokens", [1], "INT32")  # the ensemble is batched: [1, 1] expected
    unbatched.set_data_from_numpy(np.array([8], dtype=np.int32))
    text_in = grpc_inputs("x", 8)[0]
    for inputs, needle in (([text_in, bad_type], "data-type"), ([text_in, unknown], "max_new_tokens"),
                           ([text_in, unbatched], "Expected [-1,1], got [1]")):
        q: list = []
        c = grpcclient.InferenceServerClient(srv.grpc_address)
        c.start_stream(callback=lambda result, error: q.append(error))
        c.async_stream_infer("ensemble", inputs)
        wait_for(lambda: q, 20, "the gRPC error")
        c.stop_stream()
        c.close()
        assert q[0] is not None and needle in q[0].message(), q[0]
    with pytest.raises(SplitspecError, match="temperature"):
        ask_grpc(srv.grpc_address, "x", 8, temperature=-1.0)
    t.join(60)
    assert "error" not in stream, stream.get("error")
    assert stream["answer"]["output_ids"] == reference[(LONG_PROMPT, 120)]
    assert requests.get(srv.model_url("spec_decode") + "/ready", headers=CLOSE, timeout=10).status_code == 200


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def test_metrics_appear_and_move(srv):
    # a server just started may not have exported yet (every metrics_interval_s)
    def exported():
        m = scrape(srv)
        return m if metric_value(m, "splitspec_kv_total_blocks") else None

    before = wait_for(exported, 10, "the first metrics export")
    for name in ("splitspec_acceptance_length_count", "splitspec_sequence_cycles_total",
                 "splitspec_accepted_draft_tokens_total", "splitspec_draft_ms_count", "splitspec_verify_ms_count",
                 "splitspec_active_sequences", "splitspec_queued_requests", "splitspec_kv_used_blocks",
                 "splitspec_kv_total_blocks", "splitspec_kv_usage_ratio", "splitspec_engine_healthy"):
        assert any(n == name for n, _ in before), name
    assert metric_value(before, "splitspec_kv_total_blocks") == MAX_BATCH * 80 // 16
    assert metric_value(before, "splitspec_engine_healthy") == 1
    ask_http(srv.generate_url, PROMPTS[0], MAX_TOKENS, num_draft_tokens=K)

    def moved():
        m = scrape(srv)
        return m if metric_value(m, "splitspec_acceptance_length_count") > metric_value(
            before, "splitspec_acceptance_length_count") else None

    after = wait_for(moved, 5, "the metrics to be exported")
    for name in ("splitspec_cycles_total", "splitspec_draft_ms_count", "splitspec_verify_ms_count",
                 "splitspec_output_tokens_total", "splitspec_prefill_tokens_total", "splitspec_verified_sequences_total"):
        assert metric_value(after, name) > metric_value(before, name), name
    # one placement served (the split drafter): its drafting cycles counted, no switch
    assert metric_value(after, "splitspec_draft_cycles_total", draft_tp="1") > metric_value(before, "splitspec_draft_cycles_total", draft_tp="1")
    assert metric_value(after, "splitspec_placement_switches_total") == 0
    emitted = sum(metric_value(after, "splitspec_sequence_cycles_total", emitted=str(n))
                  - metric_value(before, "splitspec_sequence_cycles_total", emitted=str(n)) for n in range(1, K + 2))
    verified = metric_value(after, "splitspec_verified_sequences_total") - metric_value(before, "splitspec_verified_sequences_total")
    assert emitted == verified > 0
    # Triton's own per-model statistics sit beside ours
    for model in ("ensemble", "spec_decode", "preprocessing", "postprocessing"):
        assert metric_value(after, "nv_inference_request_success", model=model) > 0, model
    stats = requests.get(srv.model_url("ensemble") + "/stats", headers=CLOSE, timeout=10).json()
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] > 0


# ---------------------------------------------------------------------------------------------
# Several tokens per cycle (benchmark mode: every draft accepted)
# ---------------------------------------------------------------------------------------------


def test_multi_token_cycles_stream_exactly(built_engines, tok, tmp_path):
    """With every draft accepted (synthetic acceptance 1.0, benchmark mode) each cycle emits k+1
    tokens; streamed text still equals the non-streamed text and the decode of the ids, byte for byte."""
    repo = render_repo(ServeConfig(built_engines, num_draft_tokens=K, max_batch_size=16, synthetic_acceptance=[1.0]), tmp_path / "repo")
    with TritonServer(repo, exit_timeout_s=10) as s2:
        for p in PROMPTS:
            full = ask_http(s2.generate_url, p, 40, return_token_ids=True, return_stats=True)
            events = list(stream_grpc(s2.grpc_address, p, 40, return_token_ids=True))
            merged = merge(events)
            assert merged["output_ids"] == full["output_ids"], p
            assert merged["text_output"].encode() == full["text_output"].encode() == tok.decode(full["output_ids"]).encode(), p
            sizes = [len(e.get("output_ids", [])) for e in events if e.get("output_ids")]
            assert max(sizes) == K + 1, sizes
            if full["finish_reason"] == "length":
                assert full["acceptance_length"] > 3.0


# ---------------------------------------------------------------------------------------------
# Worker crash (runs last: it restarts the server)
# ---------------------------------------------------------------------------------------------


def test_worker_crash_fails_requests_reports_not_ready_and_restart_recovers(served, tok, reference):
    srv = served.get()
    workers = [p for p, role in pipeline_processes(srv.pid).items() if role.startswith("target worker")]
    assert len(workers) == 1, workers  # TP2: the leader in spec_decode's stub + one worker
    result: dict = {}

    def run_stream():
        t0 = time.monotonic()
        try:
            result["answer"] = merge(stream_grpc(srv.grpc_address, LONG_PROMPT, 200, timeout_s=60))
        except SplitspecError as e:
            result["error"] = str(e)
        result["t"] = time.monotonic() - t0

    t = threading.Thread(target=run_stream)
    t.start()
    wait_for(lambda: metric_value(scrape(srv), "splitspec_active_sequences") == 1, 20, "the stream to start")
    killed_at = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)
    t.join(30)
    assert not t.is_alive(), "the in-flight request hangs after the worker died"
    assert "error" in result, result
    assert "exited with status -9" in result["error"] and "restart the server" in result["error"], result["error"]
    print(f"\nin-flight request failed {time.monotonic() - killed_at:.2f} s after the worker was killed")

    def not_ready():
        return all(requests.get(srv.model_url(m) + "/ready", headers=CLOSE, timeout=10).status_code != 200
                   for m in ("spec_decode", "ensemble"))

    wait_for(not_ready, 30, "spec_decode and ensemble to report not ready", poll_s=0.2)
    # spec_decode unloads the ensemble with itself; tritonserver 2.51 has now and then (CI, about 1 run in 6) left the
    # ensemble live all the same, and a shutdown then waits its exit timeout out and exits 1 (docs/serving.md)
    try:
        wait_for(lambda: "successfully unloaded 'ensemble'" in srv.log_path.read_text(errors="replace"), 15,
                 "the ensemble to be unloaded with spec_decode", poll_s=0.2)
        ensemble_left = False
    except AssertionError:
        ensemble_left = True
    r = requests.post(srv.generate_url, json={"text_input": "x", "max_tokens": 4}, headers=CLOSE, timeout=10)
    assert r.status_code >= 400 and "error" in r.json()
    assert srv.is_running(), "the server itself keeps running"
    assert requests.get(srv.model_url("preprocessing") + "/ready", headers=CLOSE, timeout=10).status_code == 200

    rc = srv.stop()
    if ensemble_left:  # the known tritonserver state: only its exit timeout's "gave up" ending is allowed then
        assert rc == 0 or (rc in (1, -signal.SIGKILL) and EXIT_GAVE_UP in srv.log_tail()), srv.log_tail()
    else:
        assert rc == 0, srv.log_tail()
    stopped, srv = srv, served.get()  # a new server on the same repository
    assert srv is not stopped
    assert requests.get(srv.model_url("spec_decode") + "/ready", headers=CLOSE, timeout=10).status_code == 200
    answer = ask_http(srv.generate_url, PROMPTS[0], MAX_TOKENS, return_token_ids=True)
    assert answer["output_ids"] == reference[(PROMPTS[0], MAX_TOKENS)]
    if ensemble_left:
        pytest.xfail("tritonserver left the ensemble live after spec_decode unloaded it with itself (stop status "
                     f"{rc}); failing requests, readiness and the restart were checked all the same")


def test_stop_with_streams_open_does_not_wait_for_the_kill_timeout(served):
    """Last: a stop while streams are generating. tritonserver waits its exit timeout for them, then gives up
    ("Exit timeout expired") and hangs in its exit instead of exiting; stop() kills it then, not stop_timeout_s
    later, and nothing it started is left. The clients get an error, not a hang."""
    assert served.get().stop() == 0, served.srv.log_tail()
    served.srv = srv = TritonServer(served.repo, exit_timeout_s=1, stop_timeout_s=60, startup_timeout_s=300).start()
    pgid = srv.pid
    ended: dict[int, str] = {}
    started = [threading.Event() for _ in range(2)]
    chunks = [0, 0]

    def stream(i: int) -> None:
        try:
            for _ in stream_grpc(srv.grpc_address, LONG_PROMPT, 240, timeout_s=90):  # the test engines' max_seq_len: 256
                chunks[i] += 1
                started[i].set()
            ended[i] = "finished"
        except SplitspecError as e:
            ended[i] = f"error: {e}"
        finally:
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started) and all(chunks), f"the streams did not start: {ended}"
    log_from = srv.log_path.stat().st_size
    t0 = time.monotonic()
    srv.stop()
    took = time.monotonic() - t0
    log = srv.log_path.read_bytes()[log_from:].decode(errors="replace")
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a client still waits after the server stopped"
    assert took < 30, f"stop took {took:.1f} s: it waited for the kill timeout (60 s), not for the server's give-up"
    # the case meant: requests still in flight when the server gave up, and cut off
    assert re.search(r"has [1-9]\d* in-flight inferences", log) and "Exit timeout expired" in log, log[-3000:]
    assert any(v.startswith("error") for v in ended.values()), ended
    # stop() SIGKILLs the server's process group last; a killed process may take a moment to go
    wait_for(lambda: not _live_in_group(pgid), 15, "the processes the server started (stubs, engine process, workers) "
             "to exit", poll_s=0.2)
    print(f"\nstop with 2 streams open took {took:.1f} s; the streams: {sorted(ended.values())}")
