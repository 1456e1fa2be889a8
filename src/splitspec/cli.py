"""The ``splitspec`` command line: one subcommand per pipeline stage.

Stages, in data-flow order: ``demo-models`` → ``convert`` → ``build`` → ``generate``;
``repo`` → ``serve`` → ``client`` / ``perf``. Each subcommand builds its settings from the
arguments (:mod:`splitspec.cli_parser`) and calls one library function with keywords; errors the
user can fix are :class:`splitspec.errors.SplitspecError` and are printed as one line (exit
status 2), never as a traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from splitspec.cli_parser import build_parser
from splitspec.errors import ConfigError, SplitspecError


def _prompt_file(path: str) -> Path:
    """``--prompts``: the file, or a ConfigError saying what to pass."""
    if not Path(path).exists():
        raise ConfigError(f"--prompts {path}: no such file (run from the checkout for eval/prompts.jsonl, "
                          "or pass --prompts FILE)")
    return Path(path)


def _cmd_demo_models(a: argparse.Namespace) -> None:
    import os

    if "torch" not in sys.modules:
        # Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine spinning
        # workers can slow training steps tenfold. Must be set before torch loads its OpenMP runtime.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from splitspec.demo.pair import make_demo_models

    make_demo_models(Path(a.out), seed=a.seed, trained=not a.random, device=a.device, retrain=a.retrain)


def _cmd_convert(a: argparse.Namespace) -> None:
    from splitspec.convert.pair import convert_pair

    convert_pair(Path(a.target), Path(a.drafter), Path(a.out), tp_size=a.tp, ep_size=a.ep, aux_convention=a.aux_convention,
                 drafter_embedding=a.drafter_embedding, int4_reference=Path(a.int4_reference) if a.int4_reference else None)


def _cmd_inspect(a: argparse.Namespace) -> None:
    from splitspec.convert.describe import main as inspect_main

    inspect_main(Path(a.checkpoint), target=Path(a.target) if a.target else None, aux_convention=a.aux_convention)


def _cmd_build(a: argparse.Namespace) -> None:
    from splitspec.build.engines import build_engines

    build_engines(Path(a.checkpoints), Path(a.out), dtype=a.dtype, float_dtype=a.float_dtype, max_batch_size=a.max_batch_size,
                  max_seq_len=a.max_seq_len, max_draft_len=a.max_draft_len, gpu_memory_gib=a.gpu_memory_gib,
                  drafter_dtype=a.drafter_dtype)


def _cmd_plan(a: argparse.Namespace) -> None:
    from splitspec.build.memory_plan import GIB, Deployment
    from splitspec.build.memory_report import main as plan_main

    if a.json == "":
        raise ConfigError("--json '': expected a file path")
    if a.draft_tp != 1 and a.drafter is None:
        raise ConfigError(f"--draft-tp {a.draft_tp}: places a drafter; name it with --drafter")
    if a.draft_ahead and (a.drafter is None or a.draft_tp != 1):
        raise ConfigError("--draft-ahead: drafts ahead with a TP1 drafter only; name it with --drafter, --draft-tp 1")
    dep = Deployment(tp=a.tp, ep=a.ep, draft_tp=a.draft_tp, max_batch_size=a.max_batch_size, max_seq_len=a.max_seq_len,
                     max_draft_len=a.max_draft_len, kv_tokens=a.kv_tokens, budget_bytes=int(a.gpu_memory_gib * GIB),
                     headroom_bytes=int(a.headroom_gib * GIB), draft_ahead=a.draft_ahead)
    plan_main(Path(a.target), Path(a.drafter) if a.drafter else None, dep, dtype=a.dtype, json_out=Path(a.json) if a.json else None,
              drafter_dtype=a.drafter_dtype)


def _cmd_generate(a: argparse.Namespace) -> None:
    from splitspec.measure.closed_loop import generate
    from splitspec.measure.prompts import Prompt, read_prompts
    from splitspec.runtime.sampling import SamplingParams
    from splitspec.settings import ServeConfig

    cfg = ServeConfig.from_env(engines_dir=Path(a.engines), target_device_ids=a.device or (), draft_tp=a.draft_tp,
                               num_draft_tokens=a.num_draft_tokens, max_batch_size=max(a.concurrency, 1),
                               trust_remote_code=a.trust_remote_code)
    prompts = read_prompts(Path(a.prompts), cfg.engines_dir / "target") if a.prompts else [Prompt("prompt", a.prompt)]
    run = generate(cfg, prompts, max_tokens=a.max_tokens, sampling=SamplingParams(a.temperature, a.top_p, a.top_k, a.seed),
                   chat=a.chat, concurrency=a.concurrency, check=a.check)
    for p, r in zip(run.prompts, run.results):
        s = r.stats
        print(p.text + r.text if len(run.prompts) == 1 else f"--- {p.text[:60]!r} → {r.text[:200]!r}")
        print(f"    {s.num_output_tokens} tokens, {s.tokens_per_s:.1f} tok/s, acceptance length {s.acceptance_length:.2f} "
              f"over {s.num_cycles} cycles, accepted by position {s.accepted_per_position}, ttft {s.ttft_ms:.0f} ms, "
              f"finish {r.finish_reason}{' [SYNTHETIC]' if s.synthetic else ''}")
    total = sum(r.stats.num_output_tokens for r in run.results)
    cycles = sum(r.stats.num_cycles for r in run.results)
    emitted = sum(r.stats.acceptance_length * r.stats.num_cycles for r in run.results)
    print(f"== {len(run.results)} requests, concurrency {a.concurrency}, k={run.k}, draft_tp={run.draft_tp}: "
          f"{total} tokens in {run.wall_s:.2f} s = {total / run.wall_s:.1f} tok/s aggregate; "
          f"mean acceptance length {emitted / max(cycles, 1):.2f}")
    if run.cycles_by_placement is not None:
        by = ", ".join(f"draft_tp={d}: {n}" for d, n in run.cycles_by_placement.items())
        print(f"   cycles drafted by placement: {by}; placement switches: {run.switches}")
    if run.mismatches:
        raise SplitspecError(f"speculative output differs from target-only greedy decoding for prompts {run.mismatches}")
    if run.mismatches is not None:
        print("check: identical to target-only greedy decoding")


def _cmd_tune(a: argparse.Namespace) -> None:
    from splitspec.measure.tune import tune
    from splitspec.settings import ServeConfig

    if not Path(a.engines).is_dir():
        raise ConfigError(f"--engines {a.engines}: not a folder of built engines")
    if a.max_seq_len < 32:
        raise ConfigError(f"--max-seq-len = {a.max_seq_len}, expected ≥ 32 tokens")
    batches = a.batches
    if batches is None:  # the default buckets, capped at what the engines take
        from splitspec.engine.engine_files import read_engine_meta

        limit = int(read_engine_meta(Path(a.engines) / "target", "target")["limits"]["max_batch_size"])
        batches = sorted({min(b, limit) for b in (1, 4, 16)})
        if limit < 16:
            print(f"batch buckets {','.join(map(str, batches))} (the engines' max_batch_size is {limit})")
    cfg = ServeConfig.from_env(engines_dir=Path(a.engines), target_device_ids=a.device or (),
                               synthetic_acceptance=a.synthetic_acceptance)
    tune(cfg, sorted(batches), sorted(set(a.k)), _prompt_file(a.prompts), max_seq_len=a.max_seq_len, verify=a.verify,
         cycles=a.cycles, loads=a.loads)


def _cmd_repo(a: argparse.Namespace) -> None:
    from splitspec.serving.repo import render_repo, repo_setting
    from splitspec.settings import ServeConfig, parse_id, parse_ids

    cfg = ServeConfig.from_env(engines_dir=Path(a.engines), num_draft_tokens=a.k,
                               target_device_ids=parse_ids(a.target_device_ids, "--target-device-ids"),
                               draft_device_id=parse_id(a.draft_device_id, "--draft-device-id"), draft_tp=a.draft_tp,
                               max_batch_size=a.max_batch_size, kv_tokens=a.kv_tokens,
                               max_prompt_bytes=a.max_prompt_bytes, max_queue_len=a.max_queue_len,
                               max_queue_s=a.max_queue_s,
                               synthetic_acceptance=a.synthetic_acceptance, trust_remote_code=a.trust_remote_code,
                               request_timeout_s=a.request_timeout_s)
    out = render_repo(cfg, Path(a.out))
    k = repo_setting(out, "spec_decode", "num_draft_tokens") or f"per batch bucket from {Path(a.engines) / 'tuning.json'}"
    dtp = repo_setting(out, "spec_decode", "draft_tp") or "per batch bucket"
    why = " (tuning.json)" if a.draft_tp is None and (Path(a.engines) / "tuning.json").exists() else ""
    print(f"rendered {out}: draft_tp {dtp}{why}, k {k}")


def _cmd_serve(a: argparse.Namespace) -> None:
    from splitspec.serving.serve import serve_forever

    serve_forever(Path(a.repo), http_port=a.http_port, grpc_port=a.grpc_port, metrics_port=a.metrics_port,
                  ask=a.ask, max_tokens=a.max_tokens, openai_port=a.openai_port, served_model_name=a.served_model_name,
                  admin_key=a.admin_key, health_port=a.health_port, drain_s=a.drain_s,
                  restart_limit=a.restart_limit, stable_s=a.stable_s, stall_s=a.stall_s)


def _cmd_client(a: argparse.Namespace) -> None:
    from splitspec.serving.client import run_client

    run_client(a.prompt, url=a.url, protocol=a.protocol, max_tokens=a.max_tokens, stream=a.stream, chat=a.chat,
               num_draft_tokens=a.num_draft_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
               seed=a.seed, stop=a.stop)


def _cmd_perf(a: argparse.Namespace) -> None:
    from splitspec.measure.perf_suite import run_perf_suite
    from splitspec.settings import ServeConfig

    cfg = None if a.repo else ServeConfig.from_env(engines_dir=Path(a.engines), num_draft_tokens=a.k, draft_tp=a.draft_tp)
    run_perf_suite(cfg, repo=Path(a.repo) if a.repo else None, out_dir=Path(a.out) if a.out else None,
                   concurrencies=sorted(a.concurrency), protocols=a.protocol, max_tokens=a.max_tokens,
                   prompts_path=_prompt_file(a.prompts), seconds=a.seconds, llm_metrics=not a.no_llm_metrics,
                   llm_concurrencies=sorted(a.llm_concurrency) if a.llm_concurrency else None,
                   level_timeout_s=a.level_timeout)


def _cmd_bench(a: argparse.Namespace) -> None:
    from splitspec.measure.placement_bench import run_bench

    run_bench(Path(a.engines), out_dir=Path(a.out) if a.out else None, ks=a.k, concurrencies=a.concurrency,
              draft_tps=a.draft_tp, max_tokens=a.max_tokens, prompts_path=_prompt_file(a.prompts),
              requests_per_level=a.requests, target_device_ids=a.target_device_ids,
              draft_device_id=a.draft_device_id, synthetic_acceptance=a.synthetic_acceptance)


#: Subcommand → the function that runs it (the arguments are in :mod:`splitspec.cli_parser`).
COMMANDS = {"demo-models": _cmd_demo_models, "convert": _cmd_convert, "inspect": _cmd_inspect, "build": _cmd_build, "plan": _cmd_plan,
            "generate": _cmd_generate, "tune": _cmd_tune, "repo": _cmd_repo, "serve": _cmd_serve,
            "client": _cmd_client, "perf": _cmd_perf, "bench": _cmd_bench}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0), or a malformed argument (2; argparse printed which and why)
        return e.code if isinstance(e.code, int) else 2
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID`: stop as Ctrl-C does (servers and workers included)
    try:
        COMMANDS[args.command](args)
    except SplitspecError as e:
        print(f"splitspec {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path the command was given cannot be written or read (a file where a folder belongs, …)
        print(f"splitspec {args.command}: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # engines and workers were stopped on the way out
        print(f"splitspec {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
