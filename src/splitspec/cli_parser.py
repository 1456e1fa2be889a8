"""The ``splitspec`` command line's arguments: :func:`build_parser` and the argument types it uses.

An argument type turns the text of one flag into what the library takes (a list of levels, GPU ids, numbers),
so a malformed value is refused by argparse, naming the flag, before any command runs.
"""

from __future__ import annotations

import argparse
import math

DESCRIPTION = "The ``splitspec`` command line: one subcommand per pipeline stage."
#: Highest level a ``levels`` argument accepts (concurrency, batch bucket, k, draft_tp).
MAX_LEVEL = 256


def levels(text: str) -> list[int]:
    """``"8,1,2,2"`` → ``[8, 1, 2]``: comma-separated integers in 1..:data:`MAX_LEVEL`, in the order given,
    duplicates dropped (the order matters where the first level is the headline; sort where it does not)."""
    items = [x.strip() for x in text.split(",")]
    if not all(x.isascii() and x.isdigit() and 1 <= int(x) <= MAX_LEVEL for x in items):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers in 1..{MAX_LEVEL}, got {text!r}")
    return list(dict.fromkeys(int(x) for x in items))


def numbers(kind):
    """An argument type: a comma-separated list of ``kind`` (``int`` or ``float``)."""
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}s, got {text!r}") from None

    parse.__name__ = f"{kind.__name__}_list"
    return parse


def finite(minimum: float = 0.0, above: bool = True, maximum: float = 1e9):
    """An argument type: a float > ``minimum`` (``above``) or ≥ it, and ≤ ``maximum`` (GiB and seconds: 1e9 is
    beyond any machine); nan, inf and the rest refused by argparse."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v < minimum or (above and v == minimum) or v > maximum:
            raise argparse.ArgumentTypeError(f"expected a number {'>' if above else '≥'} {minimum:g} and ≤ {maximum:g}, "
                                             f"got {text!r}")
        return v

    parse.__name__ = "number"
    return parse


def device(text: str) -> list[int] | None:
    """``"cpu"`` → None; ``"cuda:0,1"`` → ``[0, 1]`` (one GPU per target rank)."""
    if text == "cpu":
        return None
    ids = text.removeprefix("cuda:").split(",")
    if not text.startswith("cuda:") or not all(i.isascii() and i.isdigit() for i in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: expected cpu or cuda:0,1,... (one GPU per target rank)")
    return [int(i) for i in ids]


def port(text: str) -> int:
    """A TCP port: 1..65535, or 0 for a free one picked at start."""
    if not (text.isascii() and text.isdigit() and int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"expected a TCP port in 1..65535, or 0 for a free one, got {text!r}")
    return int(text)


def count(text: str) -> int:
    """An integer ≥ 0."""
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected an integer ≥ 0, got {text!r}")
    return int(text)


def names(text: str) -> list[str]:
    """``"grpc, http"`` → ``["grpc", "http"]`` (empty items dropped)."""
    return [x.strip() for x in text.split(",") if x.strip()]


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage block left to ``--help``), for every subcommand alike."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="splitspec", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("demo-models", help="train (once per machine, cached) the demo target + EAGLE-3 drafter + tokenizer, "
                                           "or write a random pair (Hugging Face formats)")
    s.add_argument("--out", default="models/demo", help="folder to write the pair to (default %(default)s)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--random", action="store_true",
                   help="write the random-weight pair in seconds (formats and numerics only; acceptance length ~1)")
    s.add_argument("--device", default="cpu",
                   help="where to train: 'cpu' (about 17 minutes on 2 idle cores) or 'cuda[:N]' (a larger pair on a GPU)")
    s.add_argument("--retrain", action="store_true", help="train again even if the cache holds this pair "
                                                          "(cache: $SPLITSPEC_CACHE, default ~/.cache/splitspec)")

    s = sub.add_parser("convert", help="check a target + EAGLE-3 drafter pair and write rank-sharded checkpoints")
    s.add_argument("--target", required=True, help="Hugging Face target checkpoint folder")
    s.add_argument("--drafter", required=True, help="Hugging Face EAGLE-3 drafter checkpoint folder")
    s.add_argument("--out", default="checkpoints/demo", help="folder for the checked, rank-sharded checkpoints (default %(default)s)")
    s.add_argument("--tp", type=int, default=2, help="target tensor-parallel size")
    s.add_argument("--ep", type=int, default=1, help="expert-parallel size of the routed experts (divides --tp)")
    s.add_argument("--aux-convention", choices=["input", "output"], default=None,
                   help="how the drafter's aux layer ids are read, when its config does not say: "
                        "'input' = input to layer i (EAGLE, vLLM, SGLang), 'output' = output of layer i "
                        "(TensorRT-LLM, SpecForge)")
    s.add_argument("--drafter-embedding", choices=["target", "own"], default=None,
                   help="when the drafter carries an embed_tokens that differs from the target's: use the target's or "
                        "its own (default: its own, reported; an equal one or eagle_config.share_target_embedding uses the target's)")
    s.add_argument("--int4-reference", default=None, metavar="FOLDER",
                   help="for an INT4 target: a float checkpoint of the same weights; one expert's rows are unpacked and "
                        "compared with it, refusing a checkpoint packed in another nibble order")

    s = sub.add_parser("inspect", help="describe a checkpoint (target, drafter, converted or engine) without converting it")
    s.add_argument("checkpoint", help="checkpoint folder")
    s.add_argument("--target", default=None, help="for a drafter: the target checkpoint, to resolve its aux layer ids")
    s.add_argument("--aux-convention", choices=["input", "output"], default=None,
                   help="for a drafter whose config does not say how to read its aux layer ids")

    s = sub.add_parser("build", help="turn converted checkpoints into runtime engines")
    s.add_argument("--checkpoints", default="checkpoints/demo", help="splitspec convert's output folder (default %(default)s)")
    s.add_argument("--out", default="engines/demo", help="folder for the engines: target/ and drafter/ (default %(default)s)")
    s.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "fp8", "int4"],
                   help="engine dtype (default: int4 for an INT4 checkpoint, else float32); fp8 keeps an FP8 block-scaled "
                        "checkpoint's linear weights in FP8, int4 an INT4 checkpoint's routed experts packed as published "
                        "(both with --float-dtype for the rest); a float dtype dequantises them")
    s.add_argument("--float-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="with --dtype fp8 or int4: dtype of every weight not kept quantised and of the activations "
                        "(default bfloat16; float32 as CPU engines run)")
    s.add_argument("--drafter-dtype", default="float", choices=["float", "fp8"],
                   help="float: the drafter in the engine's float dtype (an FP8 drafter checkpoint dequantised); fp8: its "
                        "fc, attention and MLP linears in FP8 with 128x128 tile scales (an FP8 checkpoint's tiles kept, float "
                        "weights quantised here), embedding and lm_head in the float dtype")
    s.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded together (default %(default)s)")
    s.add_argument("--max-seq-len", type=int, default=1024, help="longest prompt + output, tokens (default %(default)s)")
    s.add_argument("--max-draft-len", type=int, default=8, help="largest draft length k the engines allow (default %(default)s)")
    s.add_argument("--gpu-memory-gib", type=finite(), default=None,
                   help="check the memory plan against this per-GPU budget (default: free memory of this machine's GPU; "
                        "none on a CPU machine)")

    s = sub.add_parser("plan", help="memory per GPU of a deployment (weights by kind, drafter, KV cache, CUDA-graph pool, "
                                    "activations, headroom) from a published config; exit 2 when it does not fit")
    s.add_argument("target", help="published target folder: config.json alone is enough, shards present give exact bytes")
    s.add_argument("--drafter", default=None, help="published EAGLE-3 drafter folder (config.json)")
    s.add_argument("--tp", type=int, required=True, help="target tensor-parallel size (GPUs)")
    s.add_argument("--ep", type=int, default=1, help="expert-parallel size of the routed experts (divides --tp)")
    s.add_argument("--draft-tp", type=int, default=1, help="1 = drafter on GPU 0 beside target rank 0; --tp = sharded")
    s.add_argument("--gpu-memory-gib", type=finite(), required=True, help="memory of each GPU, GiB")
    s.add_argument("--max-batch-size", type=int, required=True, help="sequences decoded together")
    s.add_argument("--max-seq-len", type=int, required=True, help="longest prompt + output per sequence, tokens")
    s.add_argument("--max-draft-len", type=int, default=8, help="largest k (as splitspec build's default)")
    s.add_argument("--kv-tokens", type=int, default=None, help="KV budget in tokens (default max-batch-size × max-seq-len)")
    s.add_argument("--dtype", default=None,
                   help="int4, fp8, bfloat16, float16 or float32 (default: as published; int4/fp8 keep published quantised weights)")
    s.add_argument("--drafter-dtype", default="float", choices=["float", "fp8"],
                   help="the drafter as splitspec build --drafter-dtype makes it (fp8: its linears FP8 in 128x128 tiles)")
    s.add_argument("--headroom-gib", type=finite(above=False), default=2.0, help="CUDA context, cuBLAS and NCCL workspaces per GPU")
    s.add_argument("--draft-ahead", action="store_true",
                   help="serving with SPLITSPEC_DRAFT_AHEAD=1: the draft-ahead graphs' pool on GPU 0 counted too")
    s.add_argument("--json", default=None, metavar="FILE", help="also write the plan as JSON")

    s = sub.add_parser("generate", help="speculative decoding from built engines, in this process")
    s.add_argument("--engines", default="engines/demo", help="built engines (default %(default)s)")
    s.add_argument("--prompt", default="def fibonacci(n):")
    s.add_argument("--prompts", default=None, help="file of prompts (.jsonl with 'prompt', or one per line)")
    s.add_argument("--concurrency", type=int, default=1, help="requests kept in flight")
    s.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    s.add_argument("--max-tokens", type=int, default=64, help="output tokens (default %(default)s)")
    s.add_argument("-k", "--num-draft-tokens", type=int, default=None,
                   help="draft tokens per cycle (default: engines/…/tuning.json's k per batch bucket, else 4)")
    s.add_argument("--draft-tp", type=int, default=None,
                   help="1 = drafter on its own (split placement); N = sharded over the target's group (default: tuning.json's "
                        "per batch bucket, both loaded where the buckets' differ; else 1)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 = speculative sampling")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--device", default="cpu", type=device, help="cpu, or cuda:0,1,... (one GPU per target rank)")
    s.add_argument("--check", action="store_true", help="also decode target-only and fail if greedy tokens differ")
    s.add_argument("--trust-remote-code", action="store_true",
                   help="load a tokenizer that exists only as Python code in the model folder (auto_map) with "
                        "transformers' AutoTokenizer, running that code (default: the folder is read as data only)")

    s = sub.add_parser("tune", help="measure draft placement and k per batch bucket here; write engines/…/tuning.json")
    s.add_argument("--engines", default="engines/demo", help="built engines; tuning.json is written here")
    s.add_argument("--prompts", default="eval/prompts.jsonl", help="prompts whose decoding is timed (acceptance is real)")
    s.add_argument("--batches", default=None, type=levels,
                   help="batch-size buckets (sequences decoding together; default 1,4,16, capped at the engines' max_batch_size)")
    s.add_argument("-k", default="0,1,2,3,4,5", type=numbers(int), help="draft tokens per cycle to try; must include 0 (speculation off)")
    s.add_argument("--max-seq-len", type=int, default=512, help="KV tokens per sequence (prompts are cut to half of it)")
    s.add_argument("--cycles", type=int, default=48, help="steady cycles timed per placement, batch and k (more: less noise)")
    s.add_argument("--loads", type=int, default=2, help="engine loads per placement, alternating between placements; the cycles are spread over them")
    s.add_argument("--verify", action="store_true", help="measure everything twice; score the choice against the second sweep")
    s.add_argument("--device", default="cpu", type=device, help="cpu, or cuda:0,1,... (one GPU per target rank)")
    s.add_argument("--synthetic-acceptance", default=None, metavar="P1,P2,...", type=numbers(float),
                   help="BENCHMARK ONLY: accept draft i with probability Pi (for untrained or synthetic engines)")

    s = sub.add_parser("repo", help="render the Triton model repository for built engines")
    s.add_argument("--engines", default="engines/demo", help="built engines (default %(default)s)")
    s.add_argument("--out", default="triton_repo", help="the model repository to render (default %(default)s)")
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
    s.add_argument("--max-prompt-bytes", type=int, default=None,
                   help="longest prompt in UTF-8 bytes; a longer one is refused before tokenising (default: the "
                        "engine's max_seq_len x 32)")
    s.add_argument("--max-queue-len", type=int, default=None,
                   help="requests that may wait for a batch slot; one more is refused at once as 'server busy' "
                        "(default: max-batch-size)")
    s.add_argument("--max-queue-s", type=finite(), default=None,
                   help="seconds a request may wait for a batch slot before it is refused as 'server busy' (default 60)")
    s.add_argument("--synthetic-acceptance", default=None, metavar="P1,P2,...", type=numbers(float),
                   help="BENCHMARK ONLY: accept draft position i with probability Pi regardless of its value "
                        "(served outputs are then not the target's)")
    s.add_argument("--request-timeout-s", type=finite(), default=600.0,
                   help="longest a served request may run, seconds; its deadline unless input timeout_ms sets an "
                        "earlier one (frees the slots of non-streaming clients that went away)")
    s.add_argument("--trust-remote-code", action="store_true",
                   help="load a tokenizer that exists only as Python code in the model folder (auto_map) with "
                        "transformers' AutoTokenizer, running that code (default: the folder is read as data only)")

    s = sub.add_parser("serve", help="start tritonserver on the model repository and wait (Ctrl-C stops it)")
    s.add_argument("--repo", default="triton_repo", help="the rendered model repository (default %(default)s)")
    s.add_argument("--http-port", type=port, default=8000,
                   help="the HTTP port (default 8000): a guard in front of tritonserver's HTTP, which listens on a "
                        "private loopback port. It refuses a body larger than the largest JSON a prompt of "
                        "max_prompt_bytes can take (413) and JSON nested deeper than 32 (400; either crashes "
                        "tritonserver 2.51), answers 503 while tritonserver restarts, and passes the rest on unchanged. "
                        "Every port flag: 0 = a free port picked at start, shown in the endpoints printed once ready "
                        "(and kept across restarts)")
    s.add_argument("--grpc-port", type=port, default=8001, help="tritonserver's gRPC port on loopback (default %(default)s; 0 = a free port)")
    s.add_argument("--metrics-port", type=port, default=8002, help="tritonserver's Prometheus metrics port on loopback (default %(default)s; 0 = a free port)")
    s.add_argument("--health-port", type=port, default=8003,
                   help="the supervisor's readiness, liveness and health metrics (up while tritonserver restarts; "
                        "default %(default)s)")
    s.add_argument("--drain-s", type=finite(above=False), default=10.0,
                   help="on Ctrl-C / SIGTERM new requests are refused (the OpenAI API's too, 503), and requests in "
                        "flight get this many seconds to finish before they end with finish_reason 'shutdown' (default %(default)s)")
    s.add_argument("--restart-limit", type=count, default=5,
                   help="give up (exit with an error) after this many failures in a row: restarts that failed, or "
                        "a pipeline that failed again within --stable-s of being ready (default 5; 0 = never "
                        "restart: the first fault ends serve with an error)")
    s.add_argument("--stable-s", type=finite(above=False), default=60.0,
                   help="a pipeline that served this long before a fault is restarted at once, without back-off "
                        "(default %(default)s)")
    s.add_argument("--stall-s", type=finite(), default=60.0,
                   help="restart the pipeline when the engine loop has gone this many seconds without a heartbeat "
                        "(a cycle blocked by a stalled worker, a wedged engine); longer than any legitimate cycle "
                        "(default %(default)s)")
    s.add_argument("--openai-port", type=port, default=None,
                   help="also serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) on "
                        "this port, over the gRPC endpoint (default: off; `make serve` uses 9000; 0: a free port)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name of the OpenAI API (default: the engines folder's name, e.g. demo)")
    s.add_argument("--ask", default=None, metavar="PROMPT",
                   help="once ready, send PROMPT over HTTP and gRPC, print both answers, stop the server")
    s.add_argument("--max-tokens", type=int, default=64, help="max_tokens for --ask")
    s.add_argument("--admin-key", default=None, metavar="KEY",
                   help="open tritonserver's control APIs (model repository load/unload, shared memory, logging, trace) "
                        "to requests carrying the header 'splitspec-admin-key: KEY' (gRPC metadata "
                        "'triton-grpc-protocol-splitspec-admin-key'); 16+ characters. Default: refused to every request")

    s = sub.add_parser("client", help="send one prompt to a running server and stream the answer to the terminal")
    s.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8000 for http, 127.0.0.1:8001 for grpc)")
    s.add_argument("--protocol", choices=["http", "grpc"], default="http")
    s.add_argument("--prompt", default="def fibonacci(n):")
    s.add_argument("--max-tokens", type=int, default=64, help="output tokens (default %(default)s)")
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

    s = sub.add_parser("perf", help="serve the ensemble, sweep concurrency with perf_analyzer (gRPC streaming, HTTP) "
                                    "and genai-perf, write perf_results/<timestamp>/, stop the server")
    s.add_argument("--engines", default="engines/demo",
                   help="built engines; a repository sized for the sweep (max_batch_size = highest concurrency) is "
                        "rendered into the results folder")
    s.add_argument("--repo", default=None, help="measure this already rendered repository instead of --engines")
    s.add_argument("--concurrency", default="1,2,4,8,16,32,64", type=levels, help="comma-separated concurrency levels")
    s.add_argument("--protocol", default="grpc,http", type=names, help="grpc (streaming), http (generate_stream), or both")
    s.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    s.add_argument("--prompts", default="eval/prompts.jsonl", help="JSON-lines prompts (default eval/prompts.jsonl)")
    s.add_argument("--seconds", type=float, default=3.0, help="minimum perf_analyzer measurement time per level (s)")
    s.add_argument("--llm-concurrency", default=None, type=levels,
                   help="genai-perf concurrency levels (default: the same as --concurrency)")
    s.add_argument("--no-llm-metrics", action="store_true", help="skip genai-perf")
    s.add_argument("--level-timeout", type=float, default=300.0,
                   help="hard limit per level and tool (s); the tool is killed after it")
    s.add_argument("-k", type=int, default=None,
                   help="draft tokens per cycle of the rendered repository (default: tuning.json's per batch bucket, else 4)")
    s.add_argument("--draft-tp", type=int, default=None, help="drafter placement of the rendered repository (default: tuning.json's per batch bucket, else 1)")
    s.add_argument("--out", default=None, help="results folder (default perf_results/<timestamp>)")

    s = sub.add_parser("bench", help="speculation benchmark through the served ensemble: no speculation vs the drafter "
                                     "at TP1 vs the drafter sharded over the target's group, for each k")
    s.add_argument("--engines", default="engines/demo", help="built engines (default %(default)s)")
    s.add_argument("-k", default="1,2,3,4,5", type=levels, help="draft lengths measured with speculation (k = 0 is always measured)")
    s.add_argument("--concurrency", default="1,8", type=levels, help="concurrency levels; the first is the headline")
    s.add_argument("--draft-tp", default=None, type=levels, help="comma list of drafter placements (default: 1 and the target's TP size)")
    s.add_argument("--max-tokens", type=int, default=48, help="output tokens per request")
    s.add_argument("--prompts", default="eval/prompts.jsonl", help="JSON-lines prompts (default eval/prompts.jsonl)")
    s.add_argument("--requests", type=int, default=None,
                   help="requests per configuration and concurrency (default: one per prompt)")
    s.add_argument("--target-device-ids", default="", help="comma-separated GPU ids of the target ranks (empty: CPU)")
    s.add_argument("--draft-device-id", default="", help="GPU id of the TP1 drafter (empty: target rank 0's device)")
    s.add_argument("--synthetic-acceptance", default=None, metavar="P1,P2,...", type=numbers(float),
                   help="BENCHMARK ONLY: accept draft position i with probability Pi regardless of its value")
    s.add_argument("--out", default=None, help="results folder (default bench/results/<timestamp>)")
    return p
