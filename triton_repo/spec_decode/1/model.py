"""Triton Python model ``spec_decode`` (decoupled): speculative decoding with an EAGLE-3 drafter.

A thin adapter over ``splitspec.runtime.scheduler``; what each response carries is assembled by
:mod:`splitspec.serving.responses`. The engine — a :class:`SpeculativeEngine` (the leader, rank 0
of the target's tensor-parallel group, which starts the other ranks as worker processes) and the
:class:`EngineLoop` running batched draft/verify cycles over every active request — lives in a process of
its own, started with ``sys.executable`` (:mod:`splitspec.serving.engine_process`), not in this stub: the stub's
embedded ``libpython`` is slower than the interpreter that runs the engine alone, and here the engine's
loop would share the GIL with the threads below (the module docstring of ``splitspec.serving.engine_process``
has the measurements).

Threads of the instance:

- Triton's (``execute``): validates a request and submits it to the engine process (a socket write: a
  request the engine refuses comes back, like every other event, to the reader).
- the reader (:class:`EngineProcess`): receives each engine cycle's events in one message, records the
  cycle's statistics and turns the events into responses — one per cycle when the request streams (the
  text and tokens that cycle accepted), one at the end otherwise — and sends them; the last carries
  ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``. Sending on the thread that receives saves a hand-over to
  another thread on every response's path (docs/lab/2026-11-30-triton-share-traces/). When it
  falls behind the engine, cycle messages wait in the socket. It polls ``is_cancelled()`` (an IPC round
  trip) at most every ``CANCEL_POLL_S`` per request, not every cycle, and after sending a cycle's
  response, never before it.
- the monitor: every ``metrics_interval_s`` publishes the engine's Prometheus metrics
  (:mod:`splitspec.serving.metrics`). The engine process checks the target's worker processes itself.

Text: the engine's text deltas (:mod:`splitspec.runtime.detok`) are final — a response never ends inside a
UTF-8 character or inside a possible stop string — so concatenating a stream's ``output_text`` gives
exactly the non-streamed text. When a cycle's tokens complete no character yet, no response is sent
for it (unless token ids were asked for).

Cancellation: a client that cancels a gRPC stream or drops an HTTP ``generate_stream`` connection
cancels the ensemble request; Triton 2.51 does not pass that on to this already running step, but it
marks the later postprocessing requests cancelled. Postprocessing (asking at most every ``CANCEL_POLL_S`` per stream) then sends this model a control
request carrying the stream's ``stream_id`` (input ``cancel_stream_id``), and the engine frees the
sequence's batch slot and KV blocks at the start of its next cycle. Requests sent to this model
directly are cancelled through ``is_cancelled()`` (noticed within ``CANCEL_POLL_S`` and a cycle).

Engine failure: when a target worker process (or the engine process) dies, every open request gets an
UNAVAILABLE error response (no request hangs) and the model unloads itself (``pb_utils.unload_model``, which needs
``--model-control-mode explicit``, as ``splitspec serve`` runs): ``/v2/models/spec_decode/ready`` and
the ensemble's then answer not-ready. ``splitspec serve``'s supervisor (:mod:`splitspec.serving.supervisor`) notices
the dead process and restarts the pipeline. A request that fails alone while the engine serves on (NaN or inf logits
where its next token is decided) is answered with INTERNAL (HTTP 500), ``spec_decode: internal error in this request``.

Deadlines: input ``timeout_ms``, capped by the parameter ``request_timeout_s`` (:func:`~splitspec.serving.requests.request_timeout`).

Shapes: the model is batched like the ensemble (``max_batch_size`` 1, the TensorRT-LLM backend's convention), so
every input and output carries a leading batch dimension of 1. Errors in a request are answered with INVALID_ARG
(HTTP 400) naming the input (the checks, and the inputs of that convention not implemented here:
:mod:`splitspec.serving.requests`); ``execute`` never raises. Admission: with max_batch_size requests decoding and
max_queue_len waiting, the next is refused at once, and one queued longer than max_queue_s is ended, with UNAVAILABLE
(HTTP 503) "server busy"; both count in ``splitspec_refused_requests_total``.
"""

import random
import threading
import time
import traceback

import triton_python_backend_utils as pb_utils

from splitspec.engine.plan import EngineError
from splitspec.errors import ConfigError, ServerBusy, SplitspecError
from splitspec.runtime.types import RequestOutput
from splitspec.serving.access import make_stub_region_private
from splitspec.serving.engine_process import EngineProcess
from splitspec.serving.metrics import MetricsCollector, TritonMetricsExporter
from splitspec.serving.requests import (CANCEL_INPUT, SPEC_DECODE_INPUTS, cancel_stream_id, check_capacity,
                                        check_parameters, parse_request)
from splitspec.serving.responses import Stream
from splitspec.serving.triton import error_response, model_config, read_inputs, response
from splitspec.settings import ServeConfig

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
RECOVERY_HINT = ("; the engine stopped serving and the model is unloading: restart the server (or load the "
                 "models again through the repository API)")


class TritonPythonModel:
    """Hosts the speculative engine (target leader + drafter) and streams its output."""

    def initialize(self, args):
        """Load the engines (the engine process and its reader thread) and start the monitor thread; raises to fail
        the model load."""
        make_stub_region_private()  # before the first request (no-op where the seccomp filter kept it 0600)
        self.model_name, params = model_config(args)
        self.model_name = self.model_name or "spec_decode"

        def param(name, default, cast=int):
            raw = params.get(name, "").strip()
            try:
                return cast(raw) if raw else default
            except ValueError:
                raise ConfigError(f"spec_decode/config.pbtxt: parameter '{name}' = {raw!r}, "
                                  f"expected {'an integer' if cast is int else 'a number'}") from None

        # the deployment (num_draft_tokens / draft_tp empty: tuning.json's per batch bucket, else 4 / 1)
        serve_cfg = ServeConfig.from_parameters(params)
        self.engines_dir = serve_cfg.engines_dir
        self.request_timeout_s = serve_cfg.request_timeout_s
        self.max_tokens_limit = param("max_tokens_limit", 4096)
        self.metrics_interval_s = max(0.05, param("metrics_interval_s", 0.2, float))
        self.engine = self.exporter = None
        self.lock = threading.Lock()
        self.streams = {}  # stream_id -> serving.responses.Stream, while open
        self.failure = None  # why the engine stopped serving
        self.send_lock = threading.RLock()  # one thread sends at a time: the reader, or finalize once it has stopped
        self.stopping = threading.Event()
        self._rng = random.SystemRandom()
        self.collector = MetricsCollector()
        self.engine = EngineProcess(serve_cfg, self._on_cycle, self._engine_failed)
        try:
            self._start(serve_cfg)
        except BaseException:
            self.engine.close()  # neither it nor its worker processes may outlive a failed load
            raise

    def _start(self, cfg):
        """Start the monitor thread and the metrics (after the engine loaded)."""
        if cfg.synthetic_acceptance is not None:
            pb_utils.Logger.log_warn(f"spec_decode: BENCHMARK MODE: draft tokens are accepted with probabilities "
                                     f"{list(cfg.synthetic_acceptance)} regardless of their value; outputs are NOT "
                                     "the target's")
        info = self.engine.info
        self.max_queue_len = info["max_batch_size"] if cfg.max_queue_len is None else cfg.max_queue_len
        k = f"{info['k_by_batch']} by batch bucket (tuning.json)" if info["k_by_batch"] else info["k"]
        self.exporter = TritonMetricsExporter(pb_utils, self.model_name, info["max_draft_len"])
        self.monitor_thread = threading.Thread(target=self._monitor, name="spec_decode-monitor", daemon=True)
        self.monitor_thread.start()
        warm = info.get("warm_up_s")  # on GPUs: compiled before ready
        warmed = "" if warm is None else f"; warmed up in {warm:.1f} s"
        pb_utils.Logger.log_info(
            f"spec_decode: engines {self.engines_dir} loaded (k={k}, max_batch_size "
            f"{info['max_batch_size']}, KV {info['kv_blocks']} blocks of {info['block_size']} tokens, "
            f"max_seq_len {info['max_seq_len']}, target devices {list(cfg.target_device_ids) or 'cpu'}, draft "
            f"device {'rank 0' if cfg.draft_device_id is None else [cfg.draft_device_id]}, draft_tp {info['draft_tp_by_batch'] or info['draft_tp']}"
            f"{' by batch bucket (tuning.json)' if info['draft_tp_by_batch'] else ''}); engine process pid {self.engine.pid} "
            f"({info['torch_threads']} torch threads), target worker pids {info['worker_pids']}"
            f"{warmed}")

    # ------------------------------------------------------------------ requests in

    def execute(self, requests):
        """Validate and submit each request (an error response for a bad one); never blocks on
        generation and never raises."""
        for request in requests:
            sender = None
            try:
                sender = request.get_response_sender()
                self._accept(request, sender)
            except SplitspecError as e:
                if busy := isinstance(e, ServerBusy):
                    self.collector.on_refused("queue_full")
                code = "UNAVAILABLE" if busy or isinstance(e, EngineError) else "INVALID_ARG"
                self._reply_error(sender, f"spec_decode: {e}", code)
            except Exception as e:  # never let a request take the model down
                pb_utils.Logger.log_error(f"spec_decode: {traceback.format_exc()}")
                self._reply_error(sender, f"spec_decode: internal error: {type(e).__name__}: {e}", "INTERNAL")
        return None

    @staticmethod
    def _reply_error(sender, message, code):
        if sender is None:
            return
        try:
            sender.send(error_response(message, code), flags=FINAL)
        except Exception:  # the client went away
            pb_utils.Logger.log_warn(f"spec_decode: could not send an error response: {traceback.format_exc()}")

    def _accept(self, request, sender):
        inputs = read_inputs(request, (CANCEL_INPUT, *SPEC_DECODE_INPUTS))
        cancel = cancel_stream_id(inputs)
        if cancel is not None:  # control request from postprocessing
            self._cancel_stream(cancel)
            sender.send(flags=FINAL)
            return
        check_parameters(request.parameters())
        if self.failure is not None:
            raise EngineError(f"the engine is not serving ({self.failure}){RECOVERY_HINT}")
        req, options = parse_request(inputs, self.max_tokens_limit, self.request_timeout_s, self.engine.info["vocab_size"])
        check_capacity(len(self.streams), self.engine.info["max_batch_size"], self.max_queue_len)
        st = Stream(self._rng.getrandbits(62) + 1, sender, options, len(req.prompt_ids))
        with self.lock:
            self.streams[st.sid] = st
        try:
            self.engine.submit(st.sid, req)
        except BaseException:
            with self.lock:
                self.streams.pop(st.sid, None)
            if st.done:  # the engine failed meanwhile, and _engine_failed already sent this request its error
                return
            raise
        if st.cancelled:  # cancelled while the engine process took it: make sure it got the cancellation
            self.engine.cancel(st.sid)

    def _cancel_stream(self, sid):
        with self.lock:
            st = self.streams.get(sid)
            if st is None or st.cancelled:
                return
            st.cancelled = True
            st.cancel_cycle = self.collector.cycles_seen
        self.engine.cancel(sid)

    # ------------------------------------------------------------------ responses out

    def _on_cycle(self, events, cycle_stats):
        """Reader thread, once per engine cycle: record the cycle and send its responses.

        ``events``: ``(stream_id, RequestOutput, finishing)``; ``finishing``: the request already finished in
        this cycle (its final event follows at once), so this delta is merged into the final response
        instead of being sent alone.
        """
        if cycle_stats is not None:
            self.collector.on_cycle(cycle_stats)
        with self.lock:
            items = [(self.streams.get(sid), ev, finishing) for sid, ev, finishing in events]
        for st, ev, finishing in items:
            if st is not None:
                self._handle(st, ev, finishing)

    def _handle(self, st, ev, hold, wait_s=-1):
        """Deliver one event of ``st`` (:meth:`_deliver`); a failure to send ends the stream with an error response
        instead of reaching the caller. Returns False (nothing sent) when another thread kept ``send_lock`` for
        ``wait_s`` seconds (-1: wait as long as it takes)."""
        if not self.send_lock.acquire(timeout=wait_s):
            return False
        try:
            self._deliver(st, ev, hold)
        except Exception as e:
            if not self._client_cancelled(st):
                pb_utils.Logger.log_error(f"spec_decode: sending a response failed: {traceback.format_exc()}")
                self._close(st, error=f"spec_decode: internal error: {type(e).__name__}: {e}", code="INTERNAL")
        finally:
            self.send_lock.release()
        return True

    def _client_cancelled(self, st):
        """True (and the stream cancelled) when ``st``'s request was cancelled through Triton."""
        try:
            cancelled = st.sender.is_cancelled()
        except Exception:
            return False
        if cancelled:
            self._cancel_stream(st.sid)
        return cancelled

    def _deliver(self, st, ev, hold):
        """Handle one engine event of ``st``; ``hold``: keep its delta for the stream's next response."""
        if st.done:
            return
        if ev.error is not None and ev.finish_reason in ("rejected", "busy"):  # can never be served / queued too long
            if busy := ev.finish_reason == "busy":
                self.collector.on_refused("queue_timeout")
            self._close(st, error=f"spec_decode: {ev.error}", code="UNAVAILABLE" if busy else "INVALID_ARG")
            return
        if ev.error is not None:
            self.collector.on_finished("error")
            down = self.failure or self.engine.error  # why the engine stopped serving, if it did
            if not down and not self.stopping.is_set() and ev.request_id >= 0:
                # this request failed alone (NaN or inf logits where its token is decided) and the engine serves on:
                # an internal error of the request, not an unavailable server. A submit the engine refused as not
                # serving (shutting down, or failed before the "failed" message reached us) has request id -1.
                self._close(st, error=f"spec_decode: internal error in this request (the engine serves on): "
                                      f"{ev.error}", code="INTERNAL")
                return
            message = f"spec_decode: generation failed: {down or ev.error}"
            if down and not self.stopping.is_set():
                message += RECOVERY_HINT
            self._close(st, error=message, code="UNAVAILABLE")
            return
        st.add(ev)
        if not ev.finished:
            if st.cancelled or hold:
                return
            if st.has_delta():
                st.sender.send(response(st.take_outputs()), flags=0)
            if st.poll_due(time.monotonic()):  # a request sent to this model directly may have been cancelled; asked
                self._client_cancelled(st)  # after the response, which the IPC round trip then never delays
            return
        self.collector.on_finished(ev.finish_reason, ev.stats)
        if ev.finish_reason == "cancelled" and st.cancel_cycle is not None:
            pb_utils.Logger.log_verbose(
                f"spec_decode: stream {st.sid} cancelled; its slot and KV were freed "
                f"{self.collector.cycles_seen - st.cancel_cycle} cycle(s) after the cancellation reached the model")
        self._close(st, final=response(st.take_outputs(ev)))

    def _close(self, st, final=None, error=None, code="INVALID_ARG"):
        """Send ``st``'s final response (or an error) once; forget the stream."""
        if st.done:
            return
        st.done = True
        with self.lock:
            self.streams.pop(st.sid, None)
        try:
            st.sender.send(final if error is None else error_response(error, code), flags=FINAL)
        except Exception:  # the client went away or Triton already closed a cancelled request
            if not st.cancelled:
                pb_utils.Logger.log_warn(f"spec_decode: could not send the final response: {traceback.format_exc()}")

    # ------------------------------------------------------------------ health and metrics

    def _engine_failed(self, message):
        """The engine stopped serving (reader thread): fail every open request, mark the engine unhealthy,
        and unload this model (once)."""
        with self.lock:
            if self.failure is not None or self.stopping.is_set():
                return
            self.failure = message
            open_streams = list(self.streams.values())
        pb_utils.Logger.log_error(f"spec_decode: engine failed: {message}; failing {len(open_streams)} open "
                                  f"request(s) and unloading the model")
        for st in open_streams:  # answered with the recovery hint (_deliver)
            self._handle(st, RequestOutput(-1, [], "", True, "error", None, message), False)
        threading.Thread(target=self._unload_self, name="spec_decode-unload", daemon=True).start()

    def _unload_self(self):
        try:
            # with the ensemble that depends on it: left loaded over an unloaded step, Triton 2.51 keeps the ensemble
            # live through a later shutdown, which then ends by its exit timeout with status 1
            pb_utils.unload_model(self.model_name, unload_dependents=True)
        except Exception as e:
            pb_utils.Logger.log_error(
                f"spec_decode: could not unload itself ({type(e).__name__}: {e}); the model stays loaded and "
                f"answers every request with an error until the server is restarted")

    def _gauges(self):
        g = dict(self.engine.gauges)  # as of the engine's last cycle
        g["kv_usage"] = g["kv_used"] / g["kv_total"] if g["kv_total"] else 0.0
        g["healthy"] = 0.0 if self.failure else 1.0
        return g

    def _monitor(self):
        warned = False
        while not self.stopping.wait(self.metrics_interval_s):
            try:
                self.exporter.publish(self.collector.drain(), self._gauges())
            except Exception:
                if not warned:
                    warned = True
                    pb_utils.Logger.log_warn(f"spec_decode: exporting metrics failed: {traceback.format_exc()}")

    def finalize(self):
        """Stop the threads, fail what is still open, stop the engine (its worker processes exit)."""
        pb_utils.Logger.log_info("spec_decode: finalize: stopping the engine process and its worker processes")
        self.stopping.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        if getattr(self, "monitor_thread", None) is not None:
            with self.lock:
                open_streams = list(self.streams.values())
            deadline = time.monotonic() + 10  # the engine process is gone: at most the reader's last send is under way
            for st in open_streams:
                ev = RequestOutput(-1, [], "", True, "error", None, "the model is being unloaded")
                if not self._handle(st, ev, False, wait_s=max(0.0, deadline - time.monotonic())):
                    pb_utils.Logger.log_warn("spec_decode: finalize: a response being sent did not finish within "
                                             "10 s; the open requests get no error response")
                    break
            self.monitor_thread.join(timeout=10)
        exporter, self.exporter = getattr(self, "exporter", None), None
        if exporter is not None:
            exporter.close()
