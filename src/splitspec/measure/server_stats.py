"""What a running tritonserver says about itself: its version, the engine's Prometheus counters and
Triton's per-model statistics, read before and after a measurement and subtracted.

The counters are a cross-check of what the client measured (cycles, draft / verify time); the
per-model statistics split a served request's time into Triton's phases (queue, compute input /
infer / output) for each model of the ensemble.
"""

from __future__ import annotations

import requests

from splitspec.serving.metrics import parse_prometheus
from splitspec.serving.repo import MODELS

#: Prometheus series read before / after each placement (summed over their labels).
SCRAPED = ("splitspec_cycles_total", "splitspec_verified_sequences_total", "splitspec_output_tokens_total",
           "splitspec_draft_ms_sum", "splitspec_draft_ms_count", "splitspec_verify_ms_sum", "splitspec_verify_ms_count")
#: Phases of a model's ``inference_stats`` (Triton's statistics extension), each a count and nanoseconds.
STATS_PHASES = ("success", "queue", "compute_input", "compute_infer", "compute_output")


def triton_version(http_url: str) -> str | None:
    """The server's version from ``<http_url>/v2`` (None when it does not answer)."""
    try:
        with requests.Session() as s:
            s.trust_env = False
            return s.get(f"{http_url}/v2", timeout=5, headers={"Connection": "close"}).json().get("version")
    except (requests.RequestException, ValueError):
        return None


def scrape_metrics(url: str) -> dict[str, float]:
    """The engine's counters from the Prometheus endpoint (:data:`SCRAPED`, plus
    ``accepted_position_<i>``); empty when unreachable."""
    try:
        with requests.Session() as s:
            s.trust_env = False
            text = s.get(url, timeout=10, headers={"Connection": "close"}).text
    except requests.RequestException:
        return {}
    out: dict[str, float] = {}
    for (name, labels), value in parse_prometheus(text).items():
        if name in SCRAPED:
            out[name] = out.get(name, 0.0) + value
        elif name == "splitspec_accepted_draft_tokens_total":
            pos = dict(labels).get("position", "")
            if pos.isdigit():
                out[f"accepted_position_{pos}"] = value
    return out


def model_stats(http: str) -> dict[str, dict]:
    """``{model: inference_stats}`` of the repository's models (:data:`splitspec.serving.repo.MODELS`) from Triton's
    statistics endpoint (cumulative since the model loaded; ``{phase: {"count": n, "ns": total}}``).

    Raises:
        requests.HTTPError: a model is not served (or the endpoint answered with an error).
    """
    out = {}
    with requests.Session() as s:
        s.trust_env = False  # localhost only: never through a proxy
        for m in MODELS:
            r = s.get(f"{http}/v2/models/{m}/stats", timeout=10)
            r.raise_for_status()
            out[m] = r.json()["model_stats"][0]["inference_stats"]
    return out


def stats_delta(before: dict, after: dict) -> dict[str, dict[str, tuple[int, float]]]:
    """``{model: {phase: (count, ms)}}`` between two :func:`model_stats` snapshots."""
    out = {}
    for m in MODELS:
        out[m] = {}
        for phase in STATS_PHASES:
            b, a = before[m].get(phase, {}), after[m].get(phase, {})
            out[m][phase] = (int(a.get("count", 0)) - int(b.get("count", 0)), (int(a.get("ns", 0)) - int(b.get("ns", 0))) / 1e6)
    return out
