"""bench/triton_share.py's statistics: tokens/s and their ratios, the bootstrap interval over loads and prompts,
the split of the served excess into a part per request and a part per cycle, pooling several runs, and the
printed table and plot of a run's results.

A request row is a dict with at least ``tokens`` and ``wall_ms`` (and ``prompt_id``, ``load``, ``round``,
``cycles``, ``e2e_ms`` / ``engine_e2e_ms``, ``draft_verify_ms``, ``output_sha`` where the figure needs them); the
rows of two phases are paired by position (the same request, run back to back)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from lab.triton_trace import PATH_PARTS

#: The phases of a run, in the order bench/triton_share.py sets them up (see its docstring); ``--also`` names those
#: between the first and the last, which always run. A results file holds each one's rows under its name, the first
#: phase's under ``engine``.
PHASES = ("engine_alone", "engine_loop", "engine_process", "engine_process_triton_env", "served")


def tokens_per_s(rows: list[dict]) -> float:
    """Output tokens of ``rows`` / the sum of their ``wall_ms``, in tok/s."""
    return sum(r["tokens"] for r in rows) / (sum(r["wall_ms"] for r in rows) / 1e3)


def summarize(engine: list[dict], served: list[dict]) -> dict:
    """Aggregate figures of both phases (tokens/s; ms per request, means over requests)."""
    mean = statistics.fmean
    e_tps, s_tps = tokens_per_s(engine), tokens_per_s(served)
    return {
        "engine_tokens_per_s": e_tps, "served_tokens_per_s": s_tps, "ratio_served_to_engine": s_tps / e_tps,
        "engine_tokens": sum(r["tokens"] for r in engine), "served_tokens": sum(r["tokens"] for r in served),
        "engine_ms_per_request": mean(r["wall_ms"] for r in engine),
        "served_ms_per_request": mean(r["wall_ms"] for r in served),
        "served_engine_e2e_ms_per_request": mean(r["engine_e2e_ms"] for r in served),
        "outside_engine_ms_per_request": mean(r["wall_ms"] - r["engine_e2e_ms"] for r in served),
        "engine_slower_inside_triton_ms_per_request": mean(s["engine_e2e_ms"] - e["e2e_ms"] for s, e in zip(served, engine)),
        # the engine's own time split: its cycles' draft + verify phases, and the rest (host work between them)
        "engine_draft_verify_ms_per_request": mean(r["draft_verify_ms"] for r in engine),
        "served_draft_verify_ms_per_request": mean(r["draft_verify_ms"] for r in served),
        "engine_rest_ms_per_request": mean(r["e2e_ms"] - r["draft_verify_ms"] for r in engine),
        "served_rest_ms_per_request": mean(r["engine_e2e_ms"] - r["draft_verify_ms"] for r in served),
        "engine_ttft_ms": mean(r["ttft_ms"] for r in engine), "served_ttft_ms": mean(r["ttft_ms"] for r in served),
        "served_responses_per_request": mean(r["responses"] for r in served),
        "acceptance_length": mean(r["acceptance_length"] for r in engine),
        "outputs_differing": sum(e["output_sha"] != s["output_sha"] for e, s in zip(engine, served)),
        "excess": excess_split(served, engine),
    }


def prompts_by_load(rows: list[dict]) -> dict:
    """The ``prompt_id`` values of ``rows`` by their ``load`` (0 for rows without one), loads in order of appearance."""
    out: dict = {}
    for r in rows:
        out.setdefault(r.get("load", 0), set()).add(r["prompt_id"])
    return out


def settings_of(result: dict) -> dict:
    """``result["meta"]["settings"]`` (the run's options), or {} where a results file has none or not an object."""
    meta = result.get("meta")
    settings = meta.get("settings") if isinstance(meta, dict) else None
    return settings if isinstance(settings, dict) else {}


def ratio_ci95(rows: list[dict], engine: list[dict], resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of tokens_per_s(rows) / tokens_per_s(engine) (percentile method). The request pairs
    (row i, engine i: the same prompt, run back to back) are grouped by prompt, and the prompts resampled with
    replacement ``resamples`` times: a prompt's requests in different rounds are alike, not independent draws. Rows
    of several engine loads (their ``load``) are resampled in two stages, loads first, then prompts within each drawn
    load: a load runs at a speed of its own, so its requests are not independent draws either. With few loads the
    interval is coarse (with two, it runs from one load's ratio to the other's).

    Raises:
        ValueError: the loads did not all run the same prompts.
    """
    import numpy as np

    loads = sorted({r.get("load", 0) for r in rows})
    ids = sorted({r["prompt_id"] for r in rows})
    by_load = prompts_by_load(rows)
    if any(v != set(ids) for v in by_load.values()):
        raise ValueError("the loads ran different prompts: " + "; ".join(
            f"load {x + 1}: {len(v)} of {len(ids)}" for x, v in by_load.items()) + " (an interval over loads needs the same prompts in each)")
    at_l, at_p = {x: i for i, x in enumerate(loads)}, {p: i for i, p in enumerate(ids)}
    sums = np.zeros((len(loads), len(ids), 4))  # per load and prompt: tokens and wall ms of rows, then of engine
    for r, e in zip(rows, engine):
        sums[at_l[r.get("load", 0)], at_p[r["prompt_id"]]] += (r["tokens"], r["wall_ms"], e["tokens"], e["wall_ms"])
    rng = np.random.default_rng(seed)
    li = rng.integers(0, len(loads), size=(resamples, len(loads))) if len(loads) > 1 else np.zeros((resamples, 1), int)
    pi = rng.integers(0, len(ids), size=(resamples, len(loads), len(ids)))
    t = sums[li[:, :, None], pi].sum(axis=(1, 2))  # (resamples, 4)
    ratio = (t[:, 0] / t[:, 1]) / (t[:, 2] / t[:, 3])
    return [float(x) for x in np.percentile(ratio, [2.5, 97.5])]


def excess_split(rows: list[dict], engine: list[dict]) -> dict:
    """How much longer ``rows``' requests took than the engine alone's (the same requests, pairwise), split by least
    squares into a part per request and a part per decode cycle: ``wall_ms - engine wall_ms ≈ per_request_ms +
    per_cycle_ms · cycles`` (cycles: the engine alone's count; greedy outputs are the same). With
    ``engine_ms_per_cycle`` (the engine alone's wall time per cycle, request time included) the ratio of a request of
    ``n`` cycles follows as ``n·t / (n·t + per_request_ms + n·per_cycle_ms)``; ``asymptotic_ratio`` is its limit.

    The intercept rests on the spread of the requests' lengths: with the demo prompts most requests run to
    ``max_tokens`` and only a few prompts stop early, so those few prompts set it. All four values are None when the
    split is undefined (fewer than 3 requests, no cycles, all requests of one length, values not finite);
    ``asymptotic_ratio`` also when ``t + per_cycle_ms`` is not positive.

    Raises:
        ValueError: ``rows`` and ``engine`` differ in length.
    """
    import numpy as np

    if len(rows) != len(engine):
        raise ValueError(f"excess_split: {len(rows)} rows against {len(engine)} of the engine alone")
    none = {"per_request_ms": None, "per_cycle_ms": None, "engine_ms_per_cycle": None, "asymptotic_ratio": None}
    n = np.array([e["cycles"] for e in engine], dtype=float)
    extra = np.array([r["wall_ms"] - e["wall_ms"] for r, e in zip(rows, engine)], dtype=float)
    if len(n) < 3 or n.sum() <= 0 or not (np.isfinite(n).all() and np.isfinite(extra).all()) or np.ptp(n) == 0:
        return none
    t = float(sum(e["wall_ms"] for e in engine) / n.sum())
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], axis=1), extra, rcond=None)
    return {"per_request_ms": float(a), "per_cycle_ms": float(b), "engine_ms_per_cycle": t,
            "asymptotic_ratio": t / (t + b) if t + b > 0 else None}


def phase_summary(rows: list[dict], engine: list[dict]) -> dict:
    """Figures of an in-engine phase of ``--also`` against the engine alone's rows (same requests, same order):
    tokens/s, their ratio and its 95% interval (:func:`ratio_ci95`); ms per request (means): wall, the engine's own
    e2e, its draft + verify and the rest, and how much longer its e2e was than alone's; the excess split
    (:func:`excess_split`); how many greedy outputs differ."""
    mean = statistics.fmean
    tps = tokens_per_s(rows)
    return {"tokens_per_s": tps, "ratio_to_engine_alone": tps / tokens_per_s(engine), "ratio_ci95": ratio_ci95(rows, engine),
            "ms_per_request": mean(r["wall_ms"] for r in rows), "e2e_ms_per_request": mean(r["e2e_ms"] for r in rows),
            "draft_verify_ms_per_request": mean(r["draft_verify_ms"] for r in rows),
            "rest_ms_per_request": mean(r["e2e_ms"] - r["draft_verify_ms"] for r in rows),
            "slower_than_alone_ms_per_request": mean(r["e2e_ms"] - e["e2e_ms"] for r, e in zip(rows, engine)),
            "excess": excess_split(rows, engine),
            "outputs_differing": sum(r["output_sha"] != e["output_sha"] for r, e in zip(rows, engine))}


def excess_text(x: dict) -> str:
    """One line for :func:`excess_split`'s figures."""
    if x["per_request_ms"] is None:
        return "excess over alone not split (too few requests, or all of one length)"
    limit = "—" if x["asymptotic_ratio"] is None else f"{x['asymptotic_ratio']:.3f}"
    return (f"excess over alone ≈ {x['per_request_ms']:+.2f} ms per request {x['per_cycle_ms']:+.3f} ms per cycle "
            f"(alone: {x['engine_ms_per_cycle']:.2f} ms per cycle; ratio for long requests → {limit})")


def print_table(s: dict, n: int) -> None:
    """Print the summary of :func:`summarize` for ``n`` requests."""
    rows = [("output tokens/s", f"{s['engine_tokens_per_s']:.1f}", f"{s['served_tokens_per_s']:.1f}"),
            ("ms per request (mean)", f"{s['engine_ms_per_request']:.1f}", f"{s['served_ms_per_request']:.1f}"),
            ("TTFT ms (mean)", f"{s['engine_ttft_ms']:.1f}", f"{s['served_ttft_ms']:.1f}"),
            ("output tokens", str(s["engine_tokens"]), str(s["served_tokens"]))]
    print(f"\n{'batch 1, ' + str(n) + ' requests each':28s} {'engine alone':>14s} {'served (gRPC)':>14s}")
    for name, e, v in rows:
        print(f"{name:28s} {e:>14s} {v:>14s}")
    lo, hi = s["ratio_ci95"]
    share = 1 - s["ratio_served_to_engine"]
    print(f"ratio served / engine: {s['ratio_served_to_engine']:.3f}, 95% interval {lo:.3f}–{hi:.3f} (Triton's share of "
          f"the time: {share:.1%}{', served ran faster' if share < 0 else ''}); per round: "
          f"{', '.join(f'{x:.3f}' for x in (r['ratio'] for r in s['rounds']))} (median {s['ratio_median_of_rounds']:.3f}); "
          f"median over request pairs {s['request_ratio_median']:.3f}")
    if "loads" in s:
        print("per engine load: " + ", ".join(f"{x['ratio_served_to_engine']:.3f} ({x['engine_tokens_per_s']:.0f} / "
                                              f"{x['served_tokens_per_s']:.0f} tok/s alone / served, outside the engine "
                                              f"{x['outside_engine_ms_per_request']:.1f} ms)" for x in s["loads"]))
    print(f"per request: outside the engine {s['outside_engine_ms_per_request']:.1f} ms, engine slower inside "
          f"Triton than alone {s['engine_slower_inside_triton_ms_per_request']:+.1f} ms; "
          f"{s['served_responses_per_request']:.1f} responses/request, acceptance length {s['acceptance_length']:.2f}; "
          f"greedy outputs differing: {s['outputs_differing']}")
    print(f"served: {excess_text(s['excess'])}")
    if path := s.get("served_path_ms_per_request"):
        print("served, ms per request by step (Triton's traces): " + " → ".join(f"{k} {path[k]:.2f}" for k in PATH_PARTS)
              + f"; round trips to a stub with its execute: preprocessing's {path['preprocessing_execute']:.2f}, "
              f"postprocessing's of the first response {path['first_postprocessing_execute']:.2f} and of the last "
              f"{path['last_postprocessing_execute']:.2f}; {path['responses']:.1f} responses")
    print(f"inside the engine, per request: draft + verify {s['engine_draft_verify_ms_per_request']:.1f} ms alone, "
          f"{s['served_draft_verify_ms_per_request']:.1f} ms served; the rest of its time {s['engine_rest_ms_per_request']:.1f} "
          f"ms alone, {s['served_rest_ms_per_request']:.1f} ms served")
    fmt = lambda d: ", ".join(f"{k} {v:.2f}" for k, v in d.items())  # noqa: E731
    print(f"CPU cores busy while measuring: alone (this process and its workers): {fmt(s['cores_busy_engine_alone'])}; "
          f"served (tritonserver and its process tree): {fmt(s['cores_busy_served'])}")
    print(f"CPU ms per output token: alone: {fmt(s['cpu_ms_per_output_token_engine_alone'])}; "
          f"served: {fmt(s['cpu_ms_per_output_token_served'])}")
    for m, d in s.get("triton_models_per_request", {}).items():
        print(f"  Triton, per served request: {m:15s} {d['executions']:5.1f} executions, " + ", ".join(
            f"{k.removesuffix('_ms')} {v:.2f} ms" for k, v in d.items() if k != "executions"))
    for name, ph in s["phases"].items():
        print(f"{name}: {ph['tokens_per_s']:.1f} tok/s, ratio to alone {ph['ratio_to_engine_alone']:.3f} "
              f"({ph['ratio_ci95'][0]:.3f}–{ph['ratio_ci95'][1]:.3f}); per request "
              f"e2e {ph['e2e_ms_per_request']:.1f} ms ({ph['slower_than_alone_ms_per_request']:+.1f} against alone: draft + "
              f"verify {ph['draft_verify_ms_per_request']:.1f}, rest {ph['rest_ms_per_request']:.1f}); CPU ms per output "
              f"token {fmt(s['cpu_ms_per_output_token_' + name])}; outputs differing {ph['outputs_differing']}; "
              f"{excess_text(ph['excess'])}")


#: Settings that runs pooled by ``--pool`` must share (from each file's ``meta.settings``; a file without them is
#: compared as having None).
POOL_SAME = ("k", "max_tokens", "device_ids", "draft_device_id", "draft_tp", "max_batch_size", "kv_tokens", "prompts", "pin",
             "serving_cores")


def pool_runs(runs: list[tuple[str, dict]]) -> dict:
    """Pool several runs' results (``[(name, results.json contents)]``): each run's loads become loads of their own
    (numbered in the order given; rows of a run without ``load`` are one load). Returns ``ratio`` (served tokens/s
    over alone's, all rows), ``ratio_ci95`` (:func:`ratio_ci95`, loads then prompts resampled), ``loads`` (each load's
    run and ratio) and ``outside_engine_ms_per_request`` (mean over the served rows that carry the engine's e2e).

    Raises:
        ValueError: a run's rows are malformed (:func:`_phase_rows`; served rows also need a string ``prompt_id`` and
            an integer ``load`` where they have one), its settings differ from the first run's (:data:`POOL_SAME`),
            or one of its loads ran other prompts than the first run's first load; the message starts with its
            name.
    """
    engine, served, loads = [], [], []
    for name, result in runs:
        try:
            e_rows = _phase_rows(result, "engine", cycles=False)
            s_rows = _phase_rows(result, "served", e_rows)
            for i, r in enumerate(s_rows):
                if not isinstance(r.get("prompt_id"), str) or type(r.get("load", 0)) is not int:
                    raise ValueError(f"'served' row {i}: expected a string 'prompt_id' and an integer 'load' (if any)")
            settings = {k: settings_of(result).get(k) for k in POOL_SAME}
            if not loads:
                first_name, first_settings = name, settings
            differ = [k for k in POOL_SAME if settings.get(k) != first_settings.get(k)]
            if differ:
                raise ValueError(f"its settings differ from {first_name}'s in " + ", ".join(
                    f"{k} ({settings.get(k)!r} against {first_settings.get(k)!r})" for k in differ)
                    + ": only runs of one configuration pool")
            prompts = prompts_by_load(s_rows)
            if not loads:
                first_prompts = next(iter(prompts.values()))
            for x, v in prompts.items():
                if v != first_prompts:
                    raise ValueError(f"load {x + 1} ran {len(v)} prompts, not the {len(first_prompts)} of {first_name}'s "
                                     "first load: an interval over loads needs the same prompts in each")
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        ids = sorted({r.get("load", 0) for r in s_rows})
        renum = {x: len(loads) + i for i, x in enumerate(ids)}
        for x in ids:
            pick = [i for i, r in enumerate(s_rows) if r.get("load", 0) == x]
            loads.append({"run": name, "load": renum[x],
                          "ratio": tokens_per_s([s_rows[i] for i in pick]) / tokens_per_s([e_rows[i] for i in pick])})
        served += [r | {"load": renum[r.get("load", 0)]} for r in s_rows]
        engine += e_rows
    outside = [r["wall_ms"] - r["engine_e2e_ms"] for r in served if isinstance(r.get("engine_e2e_ms"), (int, float))]
    return {"ratio": tokens_per_s(served) / tokens_per_s(engine), "ratio_ci95": ratio_ci95(served, engine),
            "loads": loads, "outside_engine_ms_per_request": statistics.fmean(outside) if outside else None}


def print_pooled(x: dict) -> None:
    """Print :func:`pool_runs`' figures."""
    lo, hi = x["ratio_ci95"]
    out = x["outside_engine_ms_per_request"]
    print(f"{len(x['loads'])} engine loads pooled: served / alone {x['ratio']:.3f}, 95% interval {lo:.3f}–{hi:.3f}"
          + ("" if out is None else f"; outside the engine {out:.2f} ms per request"))
    for ld in x["loads"]:
        print(f"  load {ld['load'] + 1}: {ld['ratio']:.3f}  ({ld['run']})")


def _real(v) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _phase_rows(result: dict, name: str, like: list[dict] | None = None, cycles: bool = True) -> list[dict]:
    """``result[name]``: request rows with a finite ``wall_ms`` > 0 and an integer ``tokens`` ≥ 0 (some > 0), an
    integer ``cycles`` ≥ 0 too for the engine alone's unless ``cycles`` is False, and where a row has
    ``engine_e2e_ms``, a finite one within 0 .. ``wall_ms``. With ``like`` (the engine alone's rows) as many rows,
    each the same request as its partner (the same ``prompt_id``, ``load`` and ``round`` where both rows have them).

    Raises:
        ValueError: naming the phase, the row and the field that is wrong.
    """
    rows = result.get(name)
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"'{name}': expected a non-empty list of request rows")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"'{name}' row {i}: expected an object, got {type(r).__name__}")
        if name == "engine" and cycles and "cycles" not in r:
            raise ValueError("'engine': its rows have no 'cycles' (results written before cycle counts were recorded)")
        if not (_real(r.get("wall_ms")) and r["wall_ms"] > 0):
            raise ValueError(f"'{name}' row {i}: wall_ms = {r.get('wall_ms')!r:.40}, expected a finite number > 0")
        for k in ("tokens", "cycles") if name == "engine" and cycles else ("tokens",):
            v = r.get(k)
            if type(v) is not int or not 0 <= v < 2 ** 53:
                raise ValueError(f"'{name}' row {i}: {k} = {v!r:.40}, expected an integer ≥ 0")
        e2e = r.get("engine_e2e_ms")
        if e2e is not None and not (_real(e2e) and 0 <= e2e <= r["wall_ms"]):
            raise ValueError(f"'{name}' row {i}: engine_e2e_ms = {e2e!r:.40}, expected a finite number within 0 .. "
                             f"its wall_ms {r['wall_ms']}")
    if not sum(r["tokens"] for r in rows):
        raise ValueError(f"'{name}': no tokens in any row")
    if like is not None:
        if len(rows) != len(like):
            raise ValueError(f"'{name}': {len(rows)} rows, but the engine alone has {len(like)}")
        for i, (r, e) in enumerate(zip(rows, like)):
            for k in ("prompt_id", "load", "round"):
                if k in r and k in e and r[k] != e[k]:
                    raise ValueError(f"'{name}' row {i} is {k} {r[k]!r:.40}, the engine alone's row {i} "
                                     f"{e[k]!r:.40}: the rows are not the same requests pairwise")
    return rows


def plot_excess(result: dict, path: Path) -> Path | None:
    """Scatter of each phase's excess over the engine alone (ms per request) against the request's cycles, with the
    :func:`excess_split` line, as PNG at ``path``; from the request rows of a ``results.json`` (``engine``, ``served``
    and any ``--also`` phases). Returns None (and says why) without matplotlib (the GPU image may lack it:
    ``--replot`` draws it later).

    Raises:
        ValueError: ``result`` is not this script's results (a phase's rows missing or malformed).
    """
    if not isinstance(result, dict):
        raise ValueError(f"expected a JSON object with the request rows, got {type(result).__name__}")
    engine = _phase_rows(result, "engine")
    phases = {name: _phase_rows(result, name, engine) for name in [*PHASES[1:-1], "served"] if name in result}
    if "served" not in phases:
        raise ValueError("'served': missing")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no matplotlib here: no plot (bench/triton_share.py --replot {path.with_suffix('.json')} draws it)")
        return None
    n = [e["cycles"] for e in engine]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in phases.items():
        x = excess_split(rows, engine)
        pts = ax.scatter(n, [r["wall_ms"] - e["wall_ms"] for r, e in zip(rows, engine)], s=8, alpha=0.5, label=name)
        if x["per_cycle_ms"] is not None:
            ax.plot([0, max(n)], [x["per_request_ms"], x["per_request_ms"] + x["per_cycle_ms"] * max(n)],
                    color=pts.get_facecolor()[0][:3],
                    label=f"{name}: {x['per_request_ms']:+.2f} ms {x['per_cycle_ms']:+.3f} ms/cycle")
    ax.axhline(0, color="grey", lw=0.5)
    meta = settings_of(result)
    ratio = tokens_per_s(phases["served"]) / tokens_per_s(engine)
    ax.set(xlabel="decode cycles of the request (engine alone)", ylabel="wall time over the engine alone's (ms)",
           title=f"Triton's share at batch 1: ratio {ratio:.3f} (k={meta.get('k', '?')}, max_tokens "
                 f"{meta.get('max_tokens', '?')}, devices {meta.get('device_ids') or 'cpu'})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

