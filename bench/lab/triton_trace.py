"""Triton's request traces: where a served request's time goes, step by step of the ensemble.

tritonserver started with :func:`trace_args` records, for every request of every model, the timestamps of Triton's
trace API (``--trace-config level=TIMESTAMPS``): ``REQUEST_START``, ``QUEUE_START``, ``COMPUTE_START``,
``COMPUTE_INPUT_END``, ``COMPUTE_OUTPUT_START``, ``COMPUTE_END``, ``REQUEST_END``, in ns of the steady clock. On
Linux that is ``CLOCK_MONOTONIC``, the clock of :func:`time.perf_counter_ns`, so a client's own times line up with
them. With ``log-frequency=1`` Triton 2.51 writes each ensemble request's traces, once all are complete, to a file of
its own, ``<file>.<index>`` (a request still open at shutdown goes to the next index then; with the default
``log-frequency=0`` nothing is written before a clean shutdown). Each file is a JSON list: per trace id one entry naming
the model (``id``, ``model_name``, ``request_id``; ``parent_id`` for the request of an ensemble step) and entries
carrying ``timestamps`` (a list of ``{"name", "ns"}``). A streamed ensemble request has one trace of the ensemble,
one of each of preprocessing and ``spec_decode`` and one of postprocessing per response.

:func:`request_path` splits a streamed request's client latency (sent → final response) into consecutive parts,
which add up to it:

- ``grpc_in``: sent → the ensemble's ``REQUEST_START`` (the client library and Triton's front end);
- ``preprocessing``: → ``spec_decode``'s ``REQUEST_START`` (preprocessing's request and the ensemble's hand-over);
- ``engine``: the engine's own submit → finish time (``e2e_ms`` of the request's statistics);
- ``spec_decode``: the rest until the last postprocessing request starts: ``spec_decode``'s queue, stub and
  ``execute`` up to the submit, the hop to the engine process and back, and sending the final response;
- ``postprocessing``: the last postprocessing request, start → end;
- ``grpc_out``: → the client's final response.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from pathlib import Path

from splitspec.errors import SplitspecError

#: Triton's timestamps of a request, in the order they occur.
TIMESTAMPS = ("REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
              "COMPUTE_END", "REQUEST_END")
#: The parts of :func:`request_path`, in the order of the time line (the engine's time lies inside ``spec_decode``'s
#: request: that part is what is left of it around the engine).
PATH_PARTS = ("grpc_in", "preprocessing", "spec_decode", "engine", "postprocessing", "grpc_out")


def trace_args(path: Path) -> tuple[str, ...]:
    """tritonserver arguments that trace every request's timestamps into files ``<path>.<index>`` (JSON, one per
    ensemble request, written as soon as its traces are complete)."""
    return ("--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1", "--trace-config", "count=-1",
            "--trace-config", "triton,log-frequency=1", "--trace-config", f"triton,file={path}")


def trace_files(path: Path) -> list[Path]:
    """The files Triton wrote for ``--trace-config triton,file=<path>``: ``path`` itself if it exists, and every
    ``<path>.<index>`` (index: ASCII digits), in index order. Never raises; [] when there are none."""
    path = Path(path)
    cut = len(path.name) + 1
    numbered = [p for p in path.parent.glob(glob.escape(path.name) + ".*")
                if p.name[cut:].isascii() and p.name[cut:].isdigit()]
    return ([path] if path.is_file() else []) + sorted(numbered, key=lambda p: int(p.name[cut:]))


@dataclass
class ModelTrace:
    """One model's trace of one request: ``model`` (its name), ``request_id`` (the client's, shared by an ensemble
    request's steps), ``parent`` (the ensemble's trace id for a step's request, else None) and ``ns``: each timestamp
    name → its times in ns, in file order (a decoupled model can record one name more than once)."""

    model: str
    request_id: str
    parent: int | None
    ns: dict[str, list[int]] = field(default_factory=dict)

    def first(self, name: str) -> int:
        """The first time of timestamp ``name``, in ns. Raises SplitspecError when the trace lacks it."""
        try:
            return self.ns[name][0]
        except (KeyError, IndexError):
            raise SplitspecError(f"trace of {self.model} (request {self.request_id!r}): no {name} timestamp") from None

    def last(self, name: str) -> int:
        """The last time of timestamp ``name``, in ns. Raises SplitspecError when the trace lacks it."""
        self.first(name)
        return self.ns[name][-1]


@dataclass
class RequestTrace:
    """A served ensemble request's traces: the ensemble's and its steps' (``steps``: sorted by ``REQUEST_START``)."""

    ensemble: ModelTrace
    steps: list[ModelTrace]

    def step(self, model: str) -> list[ModelTrace]:
        """The traces of step ``model``, in order ([] when it has none; never raises)."""
        return [s for s in self.steps if s.model == model]


def _entries(path: Path) -> list:
    try:
        entries = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise SplitspecError(f"{path}: cannot read the trace file ({e})") from None
    except json.JSONDecodeError as e:
        raise SplitspecError(f"{path}: not JSON ({e})") from None
    if not isinstance(entries, list):
        raise SplitspecError(f"{path}: expected a JSON list of trace entries, got {type(entries).__name__}")
    return entries


def load_traces(path: Path, ensemble: str = "ensemble") -> dict[str, RequestTrace]:
    """Read the trace files of one server run (:func:`trace_args`, :func:`trace_files`); returns each ``ensemble``
    request's traces by its request id. Timestamps of a trace id no entry names a model for are left out.

    Raises:
        SplitspecError: there is no trace file, or one cannot be read, is not JSON, or is not a list of trace entries;
            an entry is malformed; a trace id names two models or an ensemble request id occurs twice (files of two
            server runs mixed: Triton counts trace ids from 1 in each). The file and entry are named.
    """
    files = trace_files(Path(path))
    if not files:
        raise SplitspecError(f"{path}: no trace file (neither it nor {Path(path).name}.<index>)")
    traces: dict[int, ModelTrace] = {}
    times: list[tuple[int, str, int]] = []
    for f in files:
        for i, e in enumerate(_entries(f)):
            where = f"{f}: entry {i}"
            if not isinstance(e, dict) or not isinstance(e.get("id"), int):
                raise SplitspecError(f"{where}: expected an object with an integer 'id'")
            if "model_name" in e:
                parent = e.get("parent_id")
                if parent is not None and not isinstance(parent, int):
                    raise SplitspecError(f"{where}: 'parent_id' = {parent!r}, expected an integer")
                if e["id"] in traces:
                    raise SplitspecError(f"{where}: trace id {e['id']} named twice (traces of two server runs mixed?)")
                traces[e["id"]] = ModelTrace(str(e["model_name"]), str(e.get("request_id", "")), parent)
            stamps = e.get("timestamps", [])
            if not isinstance(stamps, list):
                raise SplitspecError(f"{where}: 'timestamps' is {type(stamps).__name__}, expected a list")
            for t in stamps:
                if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(t.get("ns"), int):
                    raise SplitspecError(f"{where}: expected timestamps as {{'name': str, 'ns': int}}, got {t!r}")
                times.append((e["id"], t["name"], t["ns"]))
    for tid, name, ns in times:
        if tid in traces:
            traces[tid].ns.setdefault(name, []).append(ns)
    children: dict[int, list[ModelTrace]] = {}
    for t in traces.values():
        if t.parent is not None:
            children.setdefault(t.parent, []).append(t)
    out: dict[str, RequestTrace] = {}
    for tid, t in traces.items():
        if t.model == ensemble and t.parent is None:
            if t.request_id in out:
                raise SplitspecError(f"{path}: ensemble request {t.request_id!r} traced twice (traces of two server "
                                     "runs mixed, or requests sent without distinct ids?)")
            steps = sorted(children.get(tid, []), key=lambda s: s.ns.get("REQUEST_START", [0])[0])
            out[t.request_id] = RequestTrace(t, steps)
    return out


def request_path(trace: RequestTrace, sent_ns: int, latency_ms: float, engine_e2e_ms: float) -> dict[str, float]:
    """A streamed request's client latency split into the parts of :data:`PATH_PARTS` (ms; they add up to
    ``latency_ms``), see the module docstring. ``grpc_out`` can come out negative: Triton takes a step's
    ``REQUEST_END`` after its response has left, so the client may have it first (by up to 0.09 ms on the H200
    host, 0.9 ms on a busy 2-core machine). Also ``responses``
    (postprocessing requests: one per response; a count) and, in ms, the round trip to a model's stub with its
    ``execute`` (``COMPUTE_INPUT_END`` → ``COMPUTE_OUTPUT_START``) of preprocessing, of the first response's
    postprocessing and of the last's: ``preprocessing_execute``, ``first_postprocessing_execute``,
    ``last_postprocessing_execute``.

    Args:
        trace: the request's traces (:func:`load_traces`).
        sent_ns: when the client sent it (:func:`time.perf_counter_ns`); latency_ms: sent → final response.
        engine_e2e_ms: the engine's own submit → finish time.
    Raises:
        SplitspecError: a step or timestamp is missing, or ``engine_e2e_ms`` is not a number (naming it).
    """
    rid = trace.ensemble.request_id
    if not isinstance(engine_e2e_ms, (int, float)) or isinstance(engine_e2e_ms, bool):
        raise SplitspecError(f"request {rid!r}: the engine's e2e time is {engine_e2e_ms!r}, expected ms (return_stats)")
    pre, spec, post = trace.step("preprocessing"), trace.step("spec_decode"), trace.step("postprocessing")
    for name, got in (("preprocessing", pre), ("spec_decode", spec), ("postprocessing", post)):
        if not got:
            raise SplitspecError(f"request {rid!r}: no trace of its {name} step")
    post = sorted(post, key=lambda t: t.first("REQUEST_START"))
    first, last = post[0], post[-1]
    ms = lambda a, b: (b - a) / 1e6  # noqa: E731
    start, spec_start = trace.ensemble.first("REQUEST_START"), spec[0].first("REQUEST_START")
    post_start, post_end = last.first("REQUEST_START"), last.last("REQUEST_END")
    parts = {"grpc_in": ms(sent_ns, start), "preprocessing": ms(start, spec_start),
             "spec_decode": ms(spec_start, post_start) - engine_e2e_ms, "engine": engine_e2e_ms,
             "postprocessing": ms(post_start, post_end), "grpc_out": latency_ms - ms(sent_ns, post_end)}
    execute = lambda t: ms(t.first("COMPUTE_INPUT_END"), t.first("COMPUTE_OUTPUT_START"))  # noqa: E731
    return parts | {"responses": len(post), "preprocessing_execute": execute(pre[0]),
                    "first_postprocessing_execute": execute(first), "last_postprocessing_execute": execute(last)}
