"""``splitspec generate``: speculative decoding from built engines in this process.

One prompt (``--prompt``) or many (``--prompts FILE``: JSON lines with a "prompt" field, or plain text,
one prompt per line), kept ``--concurrency`` requests in flight (closed loop). Prints each completion
with its statistics and an aggregate line; ``--check`` also decodes target-only and fails if any greedy
output differs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from splitspec.errors import ConfigError, SplitspecError
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import GenerationResult, Request
from splitspec.settings import ServeConfig
from splitspec.runtime.sampling import SamplingParams


def read_prompts(path: Path) -> list[str | list[dict]]:
    """Prompts from a .jsonl file ({"prompt": text} or {"messages": [chat messages]} per line) or a text file
    (one per line, \\n escapes allowed). Chat prompts come back as message lists (see :func:`encode_prompt`).

    Raises ConfigError naming the file and line for a missing or unreadable file, a line that is not such an
    object, an empty or non-string prompt, malformed messages, a bad escape, or no prompts at all."""
    try:
        lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    except FileNotFoundError:
        raise ConfigError(f"{path}: prompt file not found") from None
    except (UnicodeDecodeError, IsADirectoryError) as e:
        raise ConfigError(f"{path}: not a UTF-8 text file ({e})") from None
    out = []
    for i, ln in enumerate(lines, 1):
        if ln.lstrip().startswith("{"):
            try:
                obj = json.loads(ln)
                prompt = obj["messages"] if "messages" in obj else obj["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"{path}:{i}: expected a JSON object with a 'prompt' or 'messages' field") from None
            if isinstance(prompt, list):
                if not prompt or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                                         for m in prompt):
                    raise ConfigError(f"{path}:{i}: 'messages' must be a non-empty list of {{\"role\": str, \"content\": str}}")
            elif "messages" in obj:
                raise ConfigError(f"{path}:{i}: 'messages' must be a list of chat messages, got {type(prompt).__name__}")
            elif not isinstance(prompt, str) or not prompt:
                raise ConfigError(f"{path}:{i}: 'prompt' must be a non-empty string, got {prompt!r}")
            out.append(prompt)
        else:
            try:  # backslash escapes (\n, \t, \uXXXX) decoded; other characters kept as they are
                out.append(ln.encode("latin-1", "backslashreplace").decode("unicode_escape"))
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{i}: bad backslash escape ({e.reason}); write a backslash as \\\\") from None
    if not out:
        raise ConfigError(f"{path}: no prompts")
    return out


def encode_prompt(tok, prompt: str | list[dict], chat: bool = False) -> list[int]:
    """Token ids of a text prompt (wrapped in the chat template when ``chat``) or of a list of chat messages."""
    if isinstance(prompt, list):
        return tok.encode(tok.apply_chat_template(prompt))
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt)


def run_closed_loop(eng: SpeculativeEngine, requests: list[Request], concurrency: int) -> tuple[list[GenerationResult], float]:
    """Keep ``concurrency`` requests in flight until all are done; return results (in order) and wall seconds."""
    results: dict[int, GenerationResult] = {}
    order, acc = {}, {}
    nxt = 0
    t0 = time.perf_counter()

    def fill():
        nonlocal nxt
        while nxt < len(requests) and len(acc) < concurrency:
            rid = eng.submit(requests[nxt])
            order[rid], acc[rid] = nxt, ([], "")
            nxt += 1

    fill()
    while acc:
        for e in eng.step():
            if e.request_id not in acc:
                continue
            toks, text = acc[e.request_id]
            acc[e.request_id] = (toks + e.token_ids, text + e.text)
            if e.finished:
                toks, text = acc.pop(e.request_id)
                if e.error:
                    raise SplitspecError(f"request {order[e.request_id]} failed: {e.error}")
                results[order[e.request_id]] = GenerationResult(toks, text, e.finish_reason, e.stats)
        fill()
    return [results[i] for i in range(len(requests))], time.perf_counter() - t0


def parse_device(text: str, flag: str = "--device") -> list[int] | None:
    """``"cpu"`` → None; ``"cuda:0,1"`` → [0, 1] (one GPU per target rank).

    Raises:
        ConfigError: anything else (names ``flag``).
    """
    if text == "cpu":
        return None
    ids = text.removeprefix("cuda:").split(",")
    if not text.startswith("cuda:") or not all(i.isascii() and i.isdigit() for i in ids):
        raise ConfigError(f"{flag} {text!r}: expected cpu or cuda:0,1,... (one GPU per target rank)")
    return [int(i) for i in ids]


def main(a: argparse.Namespace, cfg: ServeConfig) -> None:
    if a.concurrency < 1:
        raise ConfigError(f"--concurrency = {a.concurrency}, expected ≥ 1")
    engines = Path(a.engines)
    prompts = read_prompts(Path(a.prompts)) if a.prompts else [a.prompt]
    with SpeculativeEngine.load(cfg) as eng:
        tok = eng.tokenizer
        if tok is None:
            raise ConfigError(f"{engines}/target: no tokenizer files beside the engine")
        sp = SamplingParams(a.temperature, a.top_p, a.top_k, a.seed)
        reqs = [Request(encode_prompt(tok, p, a.chat), a.max_tokens, sp, a.num_draft_tokens) for p in prompts]
        placed: list[tuple[int, bool]] = []  # each cycle's (placement that drafted, 0: none; whether it switched)
        eng.on_cycle = lambda cs: placed.append((cs.draft_tp, cs.switched))
        results, wall = run_closed_loop(eng, reqs, a.concurrency)
        eng.on_cycle = None
        for p, r in zip(prompts, results):
            s = r.stats
            shown = p if isinstance(p, str) else p[-1]["content"]
            print(shown + r.text if len(prompts) == 1 else f"--- {shown[:60]!r} → {r.text[:200]!r}")
            print(f"    {s.num_output_tokens} tokens, {s.tokens_per_s:.1f} tok/s, acceptance length {s.acceptance_length:.2f} "
                  f"over {s.num_cycles} cycles, accepted by position {s.accepted_per_position}, ttft {s.ttft_ms:.0f} ms, "
                  f"finish {r.finish_reason}{' [SYNTHETIC]' if s.synthetic else ''}")
        total = sum(r.stats.num_output_tokens for r in results)
        cycles = sum(r.stats.num_cycles for r in results)
        emitted = sum(r.stats.acceptance_length * r.stats.num_cycles for r in results)
        k_used = a.num_draft_tokens if a.num_draft_tokens is not None else (f"by batch {eng.k_by_batch} (tuning.json)" if eng.k_by_batch
                                                                             else eng.num_draft_tokens)
        print(f"== {len(results)} requests, concurrency {a.concurrency}, k={k_used}, draft_tp={eng.draft_tp_by_batch or eng.group.draft_tp}: "
              f"{total} tokens in {wall:.2f} s = {total / wall:.1f} tok/s aggregate; "
              f"mean acceptance length {emitted / max(cycles, 1):.2f}")
        if eng.draft_tp_by_batch:
            by = ", ".join(f"draft_tp={d}: {sum(p == d for p, _ in placed)}" for d in sorted(eng.group.placements))
            print(f"   cycles drafted by placement: {by}; placement switches: {sum(s for _, s in placed)}")
        if a.check:
            if a.temperature > 0:
                raise ConfigError("--check compares greedy outputs: use temperature 0")
            ref, _ = run_closed_loop(eng, [Request(r.prompt_ids, r.max_tokens, sp, 0) for r in reqs], a.concurrency)
            bad = [i for i, (x, y) in enumerate(zip(results, ref)) if x.token_ids != y.token_ids]
            if bad:
                raise SplitspecError(f"speculative output differs from target-only greedy decoding for prompts {bad}")
            print("check: identical to target-only greedy decoding")
