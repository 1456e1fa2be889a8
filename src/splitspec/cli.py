"""The ``splitspec`` command line: one subcommand per pipeline stage.

Stages, in data-flow order: ``demo-models`` → ``convert`` → ``build`` → ``generate``;
``repo`` → ``serve`` → ``client`` / ``perf``. Each subcommand is a thin wrapper over a
library function; errors the user can fix are :class:`splitspec.errors.SplitspecError`
and are printed as one line (exit status 2), never as a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from splitspec.errors import SplitspecError


def _cmd_demo_models(a: argparse.Namespace) -> None:
    import os

    if "torch" not in sys.modules:
        # Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine spinning
        # workers can slow training steps tenfold. Must be set before torch loads its OpenMP runtime.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from splitspec.demo.checkpoints import make_demo_models

    make_demo_models(Path(a.out), seed=a.seed, trained=not a.random, device=a.device, retrain=a.retrain)


def _cmd_convert(a: argparse.Namespace) -> None:
    from splitspec.convert.pair import convert_pair

    convert_pair(Path(a.target), Path(a.drafter), Path(a.out), tp_size=a.tp, ep_size=a.ep, aux_convention=a.aux_convention,
                 drafter_embedding=a.drafter_embedding)


def _cmd_inspect(a: argparse.Namespace) -> None:
    from splitspec.convert.describe import main as inspect_main

    inspect_main(Path(a.checkpoint), Path(a.target) if a.target else None, a.aux_convention)


def _cmd_build(a: argparse.Namespace) -> None:
    from splitspec.build.engines import build_engines

    build_engines(Path(a.checkpoints), Path(a.out), dtype=a.dtype, max_batch_size=a.max_batch_size,
                  max_seq_len=a.max_seq_len, max_draft_len=a.max_draft_len)


def _cmd_generate(a: argparse.Namespace) -> None:
    from splitspec.generate import main as generate_main, parse_device
    from splitspec.settings import ServeConfig

    cfg = ServeConfig.from_env(engines_dir=Path(a.engines), target_device_ids=parse_device(a.device) or (),
                               draft_tp=a.draft_tp, num_draft_tokens=a.num_draft_tokens, max_batch_size=max(a.concurrency, 1))
    generate_main(a, cfg)


def _cmd_tune(a: argparse.Namespace) -> None:
    from splitspec.errors import ConfigError
    from splitspec.generate import parse_device
    from splitspec.measure.tune import tune
    from splitspec.settings import ServeConfig

    def numbers(flag: str, text: str, kind=int) -> list:
        try:
            return [kind(x) for x in text.split(",")]
        except ValueError:
            raise ConfigError(f"{flag} {text!r}: expected a comma-separated list of {kind.__name__}s") from None

    device_ids = parse_device(a.device)
    synthetic = numbers("--synthetic-acceptance", a.synthetic_acceptance, float) if a.synthetic_acceptance else None
    if not Path(a.engines).is_dir():
        raise ConfigError(f"--engines {a.engines}: not a folder of built engines")
    if a.max_seq_len < 32:
        raise ConfigError(f"--max-seq-len = {a.max_seq_len}, expected ≥ 32 tokens")
    from splitspec.measure.perf_suite import parse_levels

    if a.batches is None:  # the default buckets, capped at what the engines take
        from splitspec.engine.engine_files import read_engine_meta

        limit = int(read_engine_meta(Path(a.engines) / "target", "target")["limits"]["max_batch_size"])
        a.batches = ",".join(map(str, sorted({min(b, limit) for b in (1, 4, 16)})))
        if limit < 16:
            print(f"batch buckets {a.batches} (the engines' max_batch_size is {limit})")
    cfg = ServeConfig.from_env(engines_dir=Path(a.engines), target_device_ids=device_ids or (), synthetic_acceptance=synthetic)
    tune(cfg, list(parse_levels(a.batches, "--batches")), sorted(set(numbers("-k", a.k))), Path(a.prompts),
         max_seq_len=a.max_seq_len, verify=a.verify, cycles=a.cycles, loads=a.loads)


def _cmd_repo(a: argparse.Namespace) -> None:
    from splitspec.serving.repo import render_repo

    from splitspec.measure.perf_suite import repo_setting

    from splitspec.settings import ServeConfig, parse_id, parse_ids

    cfg = ServeConfig.from_env(engines_dir=Path(a.engines), num_draft_tokens=a.k,
                               target_device_ids=parse_ids(a.target_device_ids, "--target-device-ids"),
                               draft_device_id=parse_id(a.draft_device_id, "--draft-device-id"), draft_tp=a.draft_tp,
                               max_batch_size=a.max_batch_size, kv_tokens=a.kv_tokens,
                               synthetic_acceptance=a.synthetic_acceptance)
    out = render_repo(cfg, Path(a.out))
    k = repo_setting(out, "spec_decode", "num_draft_tokens") or f"per batch bucket from {Path(a.engines) / 'tuning.json'}"
    dtp = repo_setting(out, "spec_decode", "draft_tp") or "per batch bucket"
    why = " (tuning.json)" if a.draft_tp is None and (Path(a.engines) / "tuning.json").exists() else ""
    print(f"rendered {out}: draft_tp {dtp}{why}, k {k}")


def _cmd_serve(a: argparse.Namespace) -> None:
    from splitspec.serving.tritonserver import serve_forever

    serve_forever(Path(a.repo), http_port=a.http_port, grpc_port=a.grpc_port, metrics_port=a.metrics_port,
                  ask=a.ask, max_tokens=a.max_tokens)


def _cmd_client(a: argparse.Namespace) -> None:
    from splitspec.serving.client import main as client_main

    client_main(a)


def _cmd_perf(a: argparse.Namespace) -> None:
    from splitspec.measure.perf_suite import run_perf_suite

    run_perf_suite(engines=None if a.repo else Path(a.engines), repo=Path(a.repo) if a.repo else None,
                   out_dir=Path(a.out) if a.out else None, concurrencies=a.concurrency,
                   protocols=[p.strip() for p in a.protocol.split(",") if p.strip()], max_tokens=a.max_tokens,
                   prompts_path=Path(a.prompts) if a.prompts else None, seconds=a.seconds,
                   llm_metrics=not a.no_llm_metrics, llm_concurrencies=a.llm_concurrency,
                   level_timeout_s=a.level_timeout, num_draft_tokens=a.k, draft_tp=a.draft_tp)


def _cmd_bench(a: argparse.Namespace) -> None:
    from splitspec.measure.placement_bench import main as bench_main

    bench_main(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitspec", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("demo-models", help="train (once per machine, cached) the demo target + EAGLE-3 drafter + tokenizer, "
                                           "or write a random pair (Hugging Face formats)")
    s.add_argument("--out", default="models/demo")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--random", action="store_true",
                   help="write the random-weight pair in seconds (formats and numerics only; acceptance length ~1)")
    s.add_argument("--device", default="cpu",
                   help="where to train: 'cpu' (about 10 minutes on 2 cores) or 'cuda[:N]' (a larger pair on a GPU)")
    s.add_argument("--retrain", action="store_true", help="train again even if the cache holds this pair "
                                                          "(cache: $SPLITSPEC_CACHE, default ~/.cache/splitspec)")
    s.set_defaults(func=_cmd_demo_models)

    s = sub.add_parser("convert", help="check a target + EAGLE-3 drafter pair and write rank-sharded checkpoints")
    s.add_argument("--target", required=True, help="Hugging Face target checkpoint folder")
    s.add_argument("--drafter", required=True, help="Hugging Face EAGLE-3 drafter checkpoint folder")
    s.add_argument("--out", default="checkpoints/demo")
    s.add_argument("--tp", type=int, default=2, help="target tensor-parallel size")
    s.add_argument("--ep", type=int, default=1, help="expert-parallel size of the routed experts (divides --tp)")
    s.add_argument("--aux-convention", choices=["input", "output"], default=None,
                   help="how the drafter's aux layer ids are read, when its config does not say: "
                        "'input' = input to layer i (EAGLE, vLLM, SGLang), 'output' = output of layer i "
                        "(TensorRT-LLM, SpecForge)")
    s.add_argument("--drafter-embedding", choices=["target", "own"], default=None,
                   help="when the drafter carries an embed_tokens that differs from the target's: use the target's or "
                        "its own (default: its own, reported; an equal one or eagle_config.share_target_embedding uses the target's)")
    s.set_defaults(func=_cmd_convert)

    s = sub.add_parser("inspect", help="describe a checkpoint (target, drafter, converted or engine) without converting it")
    s.add_argument("checkpoint", help="checkpoint folder")
    s.add_argument("--target", default=None, help="for a drafter: the target checkpoint, to resolve its aux layer ids")
    s.add_argument("--aux-convention", choices=["input", "output"], default=None,
                   help="for a drafter whose config does not say how to read its aux layer ids")
    s.set_defaults(func=_cmd_inspect)

    s = sub.add_parser("build", help="turn converted checkpoints into runtime engines")
    s.add_argument("--checkpoints", default="checkpoints/demo")
    s.add_argument("--out", default="engines/demo")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "fp8"],
                   help="engine dtype; fp8 keeps an FP8 block-scaled checkpoint's linear weights in FP8 (bf16 activations), "
                        "a float dtype dequantises them")
    s.add_argument("--max-batch-size", type=int, default=8)
    s.add_argument("--max-seq-len", type=int, default=1024)
    s.add_argument("--max-draft-len", type=int, default=8)
    s.set_defaults(func=_cmd_build)

    s = sub.add_parser("generate", help="speculative decoding from built engines, in this process")
    s.add_argument("--engines", default="engines/demo")
    s.add_argument("--prompt", default="def fibonacci(n):")
    s.add_argument("--prompts", default=None, help="file of prompts (.jsonl with 'prompt', or one per line)")
    s.add_argument("--concurrency", type=int, default=1, help="requests kept in flight")
    s.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("-k", "--num-draft-tokens", type=int, default=None,
                   help="draft tokens per cycle (default: engines/…/tuning.json's k per batch bucket, else 4)")
    s.add_argument("--draft-tp", type=int, default=None,
                   help="1 = drafter on its own (split placement); N = sharded over the target's group (default: tuning.json's "
                        "per batch bucket, both loaded where the buckets' differ; else 1)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--device", default="cpu", help="cpu, or cuda:0,1,... (one GPU per target rank)")
    s.add_argument("--check", action="store_true", help="also decode target-only and fail if greedy tokens differ")
    s.set_defaults(func=_cmd_generate)

    s = sub.add_parser("tune", help="measure draft placement and k per batch bucket here; write engines/…/tuning.json")
    s.add_argument("--engines", default="engines/demo", help="built engines; tuning.json is written here")
    s.add_argument("--prompts", default="eval/prompts.jsonl", help="prompts whose decoding is timed (acceptance is real)")
    s.add_argument("--batches", default=None,
                   help="batch-size buckets (sequences decoding together; default 1,4,16, capped at the engines' max_batch_size)")
    s.add_argument("-k", default="0,1,2,3,4,5", help="draft tokens per cycle to try; must include 0 (speculation off)")
    s.add_argument("--max-seq-len", type=int, default=512, help="KV tokens per sequence (prompts are cut to half of it)")
    s.add_argument("--cycles", type=int, default=48, help="steady cycles timed per placement, batch and k (more: less noise)")
    s.add_argument("--loads", type=int, default=2, help="engine loads per placement, alternating between placements; the cycles are spread over them")
    s.add_argument("--verify", action="store_true", help="measure everything twice; score the choice against the second sweep")
    s.add_argument("--device", default="cpu", help="cpu, or cuda:0,1,... (one GPU per target rank)")
    s.add_argument("--synthetic-acceptance", default=None, metavar="P1,P2,...",
                   help="BENCHMARK ONLY: accept draft i with probability Pi (for untrained or synthetic engines)")
    s.set_defaults(func=_cmd_tune)

    s = sub.add_parser("repo", help="render the Triton model repository for built engines")
    s.add_argument("--engines", default="engines/demo")
    s.add_argument("--out", default="triton_repo")
    s.add_argument("-k", type=int, default=None,
                   help="default draft tokens per cycle (default: engines/…/tuning.json's k per batch bucket, else 4)")
    s.add_argument("--target-device-ids", default="", help="comma-separated GPU ids of the target ranks (empty: CPU)")
    s.add_argument("--draft-device-id", default="", help="GPU id of the TP1 drafter (empty: target rank 0's device)")
    s.add_argument("--draft-tp", type=int, default=None,
                   help="1 = drafter on its own (split placement); N = sharded over the target's group "
                        "(default: tuning.json's per batch bucket, both loaded where the buckets' differ; else 1)")
    s.add_argument("--max-batch-size", type=int, default=None,
                   help="sequences decoded together (default: the engine's max_batch_size)")
    s.add_argument("--kv-tokens", type=int, default=None,
                   help="KV-cache budget in tokens shared by all sequences (default: max_batch_size x max_seq_len "
                        "of the engine)")
    s.add_argument("--synthetic-acceptance", default=None, metavar="P1,P2,...",
                   type=lambda v: [float(x) for x in v.split(",")],
                   help="BENCHMARK ONLY: accept draft position i with probability Pi regardless of its value "
                        "(served outputs are then not the target's)")
    s.set_defaults(func=_cmd_repo)

    s = sub.add_parser("serve", help="start tritonserver on the model repository and wait (Ctrl-C stops it)")
    s.add_argument("--repo", default="triton_repo")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--ask", default=None, metavar="PROMPT",
                   help="once ready, send PROMPT over HTTP and gRPC, print both answers, stop the server")
    s.add_argument("--max-tokens", type=int, default=64, help="max_tokens for --ask")
    s.set_defaults(func=_cmd_serve)

    s = sub.add_parser("client", help="send one prompt to a running server and stream the answer to the terminal")
    s.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8000 for http, 127.0.0.1:8001 for grpc)")
    s.add_argument("--protocol", choices=["http", "grpc"], default="http")
    s.add_argument("--prompt", default="def fibonacci(n):")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    s.add_argument("-k", "--num-draft-tokens", type=int, default=None, help="draft tokens per cycle (default: the server's)")
    s.add_argument("--temperature", type=float, default=None, help="0 = greedy (default); > 0 = speculative sampling")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--seed", type=int, default=None, help="seed of the request's sampler (reproducible output)")
    s.add_argument("--stop", action="append", default=None, metavar="STRING",
                   help="stop string (repeatable); the output ends right before it")
    s.add_argument("--no-stream", dest="stream", action="store_false",
                   help="one response at the end instead of streaming each cycle's text")
    s.set_defaults(func=_cmd_client)

    s = sub.add_parser("perf", help="serve the ensemble, sweep concurrency with perf_analyzer (gRPC streaming, HTTP) "
                                    "and genai-perf, write perf_results/<timestamp>/, stop the server")
    s.add_argument("--engines", default="engines/demo",
                   help="built engines; a repository sized for the sweep (max_batch_size = highest concurrency) is "
                        "rendered into the results folder")
    s.add_argument("--repo", default=None, help="measure this already rendered repository instead of --engines")
    s.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="comma-separated concurrency levels")
    s.add_argument("--protocol", default="grpc,http", help="grpc (streaming), http (generate_stream), or both")
    s.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    s.add_argument("--prompts", default=None, help="JSON-lines prompts (default eval/prompts.jsonl)")
    s.add_argument("--seconds", type=float, default=3.0, help="minimum perf_analyzer measurement time per level (s)")
    s.add_argument("--llm-concurrency", default=None,
                   help="genai-perf concurrency levels (default: the same as --concurrency)")
    s.add_argument("--no-llm-metrics", action="store_true", help="skip genai-perf")
    s.add_argument("--level-timeout", type=float, default=300.0,
                   help="hard limit per level and tool (s); the tool is killed after it")
    s.add_argument("-k", type=int, default=None,
                   help="draft tokens per cycle of the rendered repository (default: tuning.json's per batch bucket, else 4)")
    s.add_argument("--draft-tp", type=int, default=None, help="drafter placement of the rendered repository (default: tuning.json's per batch bucket, else 1)")
    s.add_argument("--out", default=None, help="results folder (default perf_results/<timestamp>)")
    s.set_defaults(func=_cmd_perf)

    s = sub.add_parser("bench", help="speculation benchmark through the served ensemble: no speculation vs the drafter "
                                     "at TP1 vs the drafter sharded over the target's group, for each k")
    s.add_argument("--engines", default="engines/demo")
    s.add_argument("-k", default="1,2,3,4,5", help="draft lengths measured with speculation (k = 0 is always measured)")
    s.add_argument("--concurrency", default="1,8", help="concurrency levels; the first is the headline")
    s.add_argument("--draft-tp", default=None, help="comma list of drafter placements (default: 1 and the target's TP size)")
    s.add_argument("--max-tokens", type=int, default=48, help="output tokens per request")
    s.add_argument("--prompts", default=None, help="JSON-lines prompts (default eval/prompts.jsonl)")
    s.add_argument("--requests", type=int, default=None,
                   help="requests per configuration and concurrency (default: one per prompt)")
    s.add_argument("--target-device-ids", default="", help="comma-separated GPU ids of the target ranks (empty: CPU)")
    s.add_argument("--draft-device-id", default="", help="GPU id of the TP1 drafter (empty: target rank 0's device)")
    s.add_argument("--synthetic-acceptance", default=None, metavar="P1,P2,...",
                   type=lambda v: [float(x) for x in v.split(",")],
                   help="BENCHMARK ONLY: accept draft position i with probability Pi regardless of its value")
    s.add_argument("--out", default=None, help="results folder (default bench/results/<timestamp>)")
    s.set_defaults(func=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SplitspecError as e:
        print(f"splitspec {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # engines and workers were stopped on the way out
        print(f"splitspec {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
