"""The supervisor's own HTTP endpoint: readiness, liveness and health metrics of the served pipeline, answered by
``splitspec serve`` itself, so they stay up while tritonserver is down or restarting (where its ``/metrics`` and
``/v2/health/*`` do not answer at all, and a model's metrics vanish with the model).

- ``GET /v2/health/ready``: 200 while the pipeline serves, 503 while it is failed, restarting or stopping.
- ``GET /v2/health/live``: 200 while the supervisor runs and has not given up (503 after that).
- ``GET /metrics``: Prometheus text format (https://prometheus.io/docs/instrumenting/exposition_formats/):
  ``splitspec_pipeline_healthy`` (gauge, 1 / 0), ``splitspec_pipeline_restarts_total`` (counter),
  ``splitspec_pipeline_last_recovery_seconds`` (gauge: fault noticed → ready again, seconds; 0 before any).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

#: (name, type, help) of the exported series, in order.
SERIES = (("splitspec_pipeline_healthy", "gauge", "1 while the served pipeline is up and ready; 0 while it is failed, "
           "restarting or stopping"),
          ("splitspec_pipeline_restarts_total", "counter", "Automatic restarts of the pipeline after a fault"),
          ("splitspec_pipeline_last_recovery_seconds", "gauge", "Seconds from the last fault noticed to ready again"))


def render_metrics(values: dict[str, float]) -> str:
    """The :data:`SERIES` with ``values`` (name → value; a missing one is 0) in Prometheus text format."""
    lines = []
    for name, kind, text in SERIES:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {float(values.get(name, 0.0)):g}"]
    return "\n".join(lines) + "\n"


class HealthEndpoint:
    """Serves :data:`SERIES` and the two probes on ``host:port`` from a daemon thread (port 0: a free one, then in
    :attr:`port`). ``state()`` returns ``(ready, live, metric values)``; it is called per request."""

    def __init__(self, host: str, port: int, state: Callable[[], tuple[bool, bool, dict[str, float]]]):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                ready, live, values = state()
                if self.path == "/metrics":
                    self._answer(200, render_metrics(values), "text/plain; version=0.0.4")
                elif self.path == "/v2/health/ready":
                    self._answer(200 if ready else 503, "")
                elif self.path == "/v2/health/live":
                    self._answer(200 if live else 503, "")
                else:
                    self._answer(404, "not found: /metrics, /v2/health/ready and /v2/health/live are served here\n")

            def _answer(self, code: int, body: str, ctype: str = "text/plain") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # probes every few seconds: not worth a line each
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="splitspec-health", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
