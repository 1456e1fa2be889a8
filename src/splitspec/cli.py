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
    from splitspec.demo import make_demo_models

    make_demo_models(Path(a.out), seed=a.seed)


def _cmd_convert(a: argparse.Namespace) -> None:
    from splitspec.convert import convert_pair

    convert_pair(Path(a.target), Path(a.drafter), Path(a.out), tp_size=a.tp, ep_size=a.ep, aux_convention=a.aux_convention,
                 drafter_embedding=a.drafter_embedding)


def _cmd_inspect(a: argparse.Namespace) -> None:
    from splitspec.inspect import main as inspect_main

    inspect_main(Path(a.checkpoint), Path(a.target) if a.target else None, a.aux_convention)


def _cmd_build(a: argparse.Namespace) -> None:
    from splitspec.build import build_engines

    build_engines(Path(a.checkpoints), Path(a.out), dtype=a.dtype, max_batch_size=a.max_batch_size,
                  max_seq_len=a.max_seq_len, max_draft_len=a.max_draft_len)


def _cmd_generate(a: argparse.Namespace) -> None:
    from splitspec.generate import main as generate_main

    generate_main(a)


def _cmd_repo(a: argparse.Namespace) -> None:
    from splitspec.repo import render_repo

    render_repo(Path(a.engines), Path(a.out), num_draft_tokens=a.k, target_device_ids=a.target_device_ids,
                draft_device_id=a.draft_device_id, draft_tp=a.draft_tp)


def _cmd_serve(a: argparse.Namespace) -> None:
    from splitspec.server import serve_forever

    serve_forever(Path(a.repo), http_port=a.http_port, grpc_port=a.grpc_port, metrics_port=a.metrics_port,
                  ask=a.ask, max_tokens=a.max_tokens)


def _cmd_client(a: argparse.Namespace) -> None:
    from splitspec.client import main as client_main

    client_main(a)


def _cmd_perf(a: argparse.Namespace) -> None:
    from splitspec.perf import run_perf

    run_perf(Path(a.repo), seconds=a.seconds, concurrency=a.concurrency, out_dir=Path(a.out))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitspec", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("demo-models", help="write the tiny demo target, drafter and tokenizer (Hugging Face formats)")
    s.add_argument("--out", default="models/demo")
    s.add_argument("--seed", type=int, default=0)
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
    s.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    s.add_argument("--draft-tp", type=int, default=1, help="1 = drafter on its own (split placement); N = sharded over the target's group")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--device", default="cpu", help="cpu, or cuda:0,1,... (one GPU per target rank)")
    s.add_argument("--check", action="store_true", help="also decode target-only and fail if greedy tokens differ")
    s.set_defaults(func=_cmd_generate)

    s = sub.add_parser("repo", help="render the Triton model repository for built engines")
    s.add_argument("--engines", default="engines/demo")
    s.add_argument("--out", default="triton_repo")
    s.add_argument("-k", type=int, default=4, help="draft tokens per cycle")
    s.add_argument("--target-device-ids", default="", help="comma-separated GPU ids of the target ranks (empty: CPU)")
    s.add_argument("--draft-device-id", default="", help="GPU id of the TP1 drafter (empty: target rank 0's device)")
    s.add_argument("--draft-tp", type=int, default=1)
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

    s = sub.add_parser("client", help="send one prompt to a running server and print the answer")
    s.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8000 for http, 127.0.0.1:8001 for grpc)")
    s.add_argument("--protocol", choices=["http", "grpc"], default="http")
    s.add_argument("--prompt", default="def fibonacci(n):")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    s.add_argument("-k", "--num-draft-tokens", type=int, default=None, help="draft tokens per cycle (default: the server's)")
    s.set_defaults(func=_cmd_client)

    s = sub.add_parser("perf", help="start the server, run perf_analyzer against the ensemble, stop the server")
    s.add_argument("--repo", default="triton_repo")
    s.add_argument("--seconds", type=float, default=5.0)
    s.add_argument("--concurrency", default="1")
    s.add_argument("--out", default="perf_results")
    s.set_defaults(func=_cmd_perf)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SplitspecError as e:
        print(f"splitspec {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
