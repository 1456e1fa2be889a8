"""The ensemble in the TensorRT-LLM backend's convention, through a real tritonserver (the session's shared one).

Requests are built exactly as the two clients written for TensorRT-LLM ensembles build them: the backend's
``inflight_batcher_llm/client/end_to_end_grpc_client.py`` (``prepare_inputs``: every value ``np.array([[v]])``, word
lists ``np.array([words], dtype=object)``, ``exclude_input_in_output`` always sent, ``text_output`` read as
``output[0].decode()``, ``batch_index`` as ``[0][0]``) and Triton's OpenAI front end (``_create_trtllm_generate_request``:
``seed`` — ``random_seed`` in older versions — as UINT64, ``top_p``, the penalties at OpenAI's defaults, token counts
asked for and summed over a stream). Greedy text is checked against the engine run in this process (target only,
k = 0: independent of the drafter and of the server).
"""

from __future__ import annotations

import queue

import numpy as np
import pytest
import requests

from splitspec.serving.client import ask_http, merge, stream_grpc

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

PROMPT = "def fibonacci(n):"
MAX_TOKENS = 16
CLOSE = {"Connection": "close"}


@pytest.fixture(scope="module")
def tok(built_engines):
    from splitspec.runtime.tokenizer import ChatTokenizer

    return ChatTokenizer.from_dir(built_engines / "target")


@pytest.fixture(scope="module")
def reference(built_engines, tok) -> list[int]:
    """Greedy output ids of PROMPT from the engine in this process (target only), before the server starts."""
    from splitspec.runtime.scheduler import SpeculativeEngine
    from splitspec.settings import ServeConfig

    with SpeculativeEngine.load(ServeConfig(built_engines, num_draft_tokens=0, max_batch_size=1)) as eng:
        return eng.generate(tok.encode(PROMPT), MAX_TOKENS, num_draft_tokens=0).token_ids


@pytest.fixture
def srv(shared_server, reference):
    return shared_server.get()


def _inputs(values: dict) -> list:
    """tritonclient InferInputs of ``values`` (NumPy arrays, shaped as the client under test shapes them)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    out = []
    for name, a in values.items():
        t = grpcclient.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
        t.set_data_from_numpy(a)
        out.append(t)
    return out


def _stream(address: str, values: dict, outputs: list[str] | None = None) -> list:
    """Send one request over a gRPC stream; the results (or the error message) until the final response."""
    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(address)
    c.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        c.async_stream_infer("ensemble", _inputs(values), enable_empty_final_response=True,
                             outputs=[grpcclient.InferRequestedOutput(o) for o in outputs] if outputs else None)
        got = []
        while True:
            result, error = answers.get(timeout=120)
            if error is not None:
                return [error.message()]
            got.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        c.stop_stream()
        c.close()


def _e2e_client_inputs(prompt: str, output_len: int, *, streaming: bool, temperature: float,
                       stop_words: list[str] | None = None, beam_width: int = 1, bad_words: list[str] | None = None,
                       num_return_sequences: int | None = None, exclude_input_in_output: bool = False) -> dict:
    """The inputs end_to_end_grpc_client.py's prepare_inputs builds (its defaults: no penalties, no ids)."""
    input0 = [[prompt]]
    inputs = {"text_input": np.array(input0).astype(object),
              "max_tokens": np.ones_like(input0).astype(np.int32) * output_len,
              "stream": np.array([[streaming]], dtype=bool), "beam_width": np.array([[beam_width]], dtype=np.int32),
              "temperature": np.array([[temperature]], dtype=np.float32)}
    if num_return_sequences is not None:
        inputs["num_return_sequences"] = np.array([[num_return_sequences]], dtype=np.int32)
    if bad_words:
        inputs["bad_words"] = np.array([bad_words], dtype=object)
    if stop_words:
        inputs["stop_words"] = np.array([stop_words], dtype=object)
    inputs["exclude_input_in_output"] = np.array([[exclude_input_in_output]], dtype=bool)
    return inputs


def _e2e_text(results: list, streaming: bool) -> str:
    """The text as end_to_end_grpc_client.py reads it: ``output[0].decode()``, appended when streaming."""
    text = ""
    for r in results:
        output = r.as_numpy("text_output")
        if output is None:  # the empty final response
            continue
        batch_index = r.as_numpy("batch_index")
        assert (0 if batch_index is None else batch_index[0][0]) == 0
        text = text + output[0].decode("utf-8") if streaming else output[0].decode("utf-8")
    return text


def test_end_to_end_grpc_client_requests(srv, tok, reference):
    """Greedy, streamed and not: the reference text (after the prompt, when not streamed and
    exclude_input_in_output is false, as that client expects); stop_words end the text before the stop string;
    temperature 1.0 (the client's default) samples; return_perf_metrics gives the speculation counts."""
    want = tok.decode(reference)
    for streaming in (False, True):
        got = _e2e_text(_stream(srv.grpc_address, _e2e_client_inputs(PROMPT, MAX_TOKENS, streaming=streaming,
                                                                     temperature=0.0), ["text_output"]), streaming)
        assert got == (want if streaming else PROMPT + want), streaming
    plain = _stream(srv.grpc_address, _e2e_client_inputs(PROMPT, MAX_TOKENS, streaming=False, temperature=0.0,
                                                         exclude_input_in_output=True))
    assert _e2e_text(plain, False) == want
    at = next(i for i in range(3, len(want) - 2) if want[i:i + 2].strip() and "\ufffd" not in want[i:i + 2])
    stop = want[at:at + 2]
    results = _stream(srv.grpc_address, _e2e_client_inputs(PROMPT, MAX_TOKENS, streaming=True, temperature=0.0,
                                                           stop_words=[stop], num_return_sequences=1))
    assert _e2e_text(results, True) == want[:want.index(stop)]
    sampled = _stream(srv.grpc_address, _e2e_client_inputs(PROMPT, MAX_TOKENS, streaming=True, temperature=1.0))
    assert not isinstance(sampled[0], str) and _e2e_text(sampled, True)
    values = _e2e_client_inputs(PROMPT, MAX_TOKENS, streaming=False, temperature=0.0, exclude_input_in_output=True)
    values["return_perf_metrics"] = np.array([[True]], dtype=bool)
    (final,) = _stream(srv.grpc_address, values, ["text_output", "acceptance_rate", "total_accepted_draft_tokens",
                                                 "total_draft_tokens"])
    accepted, drafted = (int(final.as_numpy(n)[0][0]) for n in ("total_accepted_draft_tokens", "total_draft_tokens"))
    assert 0 <= accepted <= drafted and drafted > 0 and drafted % 4 == 0  # k = 4 per cycle
    assert final.as_numpy("acceptance_rate")[0][0] == pytest.approx(accepted / drafted)
    stats = ask_http(srv.generate_url, PROMPT, MAX_TOKENS, return_stats=True)
    assert stats["total_accepted_draft_tokens"] == sum(stats["accepted_per_position"])


def test_openai_front_end_requests(srv, tok, reference):
    """Seeded sampling is reproducible whichever name carries the seed and whichever protocol; greedy is the
    reference; num_input_tokens is the prompt's length in every response and num_output_tokens sums to the
    output's."""

    def openai(stream: bool, temperature: float, seed: int, seed_name: str = "seed") -> dict:
        return {"text_input": np.array([[PROMPT]], dtype=object), "stream": np.bool_([[stream]]),
                "max_tokens": np.int32([[MAX_TOKENS]]), "top_p": np.float32([[0.95 if temperature else 1.0]]),
                "frequency_penalty": np.float32([[0.0]]), "presence_penalty": np.float32([[0.0]]),
                seed_name: np.uint64([[seed]]), "temperature": np.float32([[temperature]]),
                "return_num_input_tokens": np.bool_([[True]]), "return_num_output_tokens": np.bool_([[True]])}

    def read(results) -> tuple[str, list[int], list[int]]:
        text, n_in, n_out = "", [], []
        for r in results:
            if r.as_numpy("text_output") is not None:
                text += r.as_numpy("text_output")[0].decode()
                n_in.append(int(r.as_numpy("num_input_tokens")[0][0]))
                n_out.append(int(r.as_numpy("num_output_tokens")[0][0]))
        return text, n_in, n_out

    n_prompt = len(tok.encode(PROMPT))
    for stream in (True, False):
        text, n_in, n_out = read(_stream(srv.grpc_address, openai(stream, 0.0, 1)))
        assert text == tok.decode(reference) and set(n_in) == {n_prompt} and sum(n_out) == len(reference)
        assert len(n_out) > 1 if stream else len(n_out) == 1
    sampled = {}
    for seed in (1, 2):
        runs = [read(_stream(srv.grpc_address, openai(True, 0.9, seed, name)))[0] for name in ("seed", "random_seed")]
        runs.append(ask_http(srv.generate_url, PROMPT, MAX_TOKENS, temperature=0.9, top_p=0.95, seed=seed)["text_output"])
        assert len(set(runs)) == 1, runs
        sampled[seed] = runs[0]
    assert sampled[1] != sampled[2]


REFUSED = [
    ({"bad_words": np.array([["fibonacci"]], dtype=object)}, "bad_words = ['fibonacci']: not supported"),
    ({"beam_width": np.int32([[2]])}, "beam_width = 2: not supported by this server; accepted: 1"),
    ({"num_return_sequences": np.int32([[2]])}, "num_return_sequences = 2: not supported"),
    ({"repetition_penalty": np.float32([[1.2]])}, "repetition_penalty = 1.2: not supported"),
    ({"return_log_probs": np.array([[True]])}, "return_log_probs = true: not supported"),
    ({"max_tokens": np.float32([[8.0]])}, "data-type is 'FP32', but model 'ensemble' expects 'INT32'"),
    ({"n": np.int32([[2]])}, "unexpected inference input 'n'"),
    ({"text_input": np.array([["x " * 400]], dtype=object)}, "max_seq_len"),
    ({"text_input": np.array(["x"], dtype=object)}, "Expected [-1,1], got [1]"),
]


def test_refused_requests_name_the_input_while_a_stream_continues(srv, tok, reference):
    """Controls this server does not implement, a wrong type, an unknown input, an oversize prompt and an
    unbatched shape each get one clear error over gRPC; HTTP generate answers the same and invalid JSON; a greedy
    stream sent before them all completes with the reference."""
    long_run = stream_grpc(srv.grpc_address, PROMPT, MAX_TOKENS, return_token_ids=True)
    first = next(long_run)
    base = {"text_input": np.array([[PROMPT]], dtype=object), "max_tokens": np.int32([[8]])}
    for extra, needle in REFUSED:
        (message,) = _stream(srv.grpc_address, {**base, **extra})
        assert isinstance(message, str) and needle in message, (extra, message)
    for body, needle in (({"beam_width": 2}, "beam_width = 2"), ({"bad_words": ["x"]}, "bad_words = ['x']"),
                         ({"frequency_penalty": 0.5}, "frequency_penalty = 0.5")):
        r = requests.post(srv.generate_url, json={"text_input": PROMPT, "max_tokens": 8, **body}, headers=CLOSE, timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"], r.text
    r = requests.post(srv.generate_url, data='{"text_input": "x", "max_tokens": ', headers=CLOSE, timeout=60)
    assert r.status_code >= 400 and "JSON" in r.json()["error"], r.text
    # the TensorRT-LLM backend's documented curl request: empty bad_words and stop_words mean none
    r = requests.post(srv.generate_url, json={"text_input": PROMPT, "max_tokens": MAX_TOKENS, "bad_words": "",
                                              "stop_words": ""}, headers=CLOSE, timeout=60)
    assert r.status_code == 200 and r.json()["text_output"] == tok.decode(reference), r.text
    rest = merge([first, *long_run])
    assert rest["output_ids"] == reference
