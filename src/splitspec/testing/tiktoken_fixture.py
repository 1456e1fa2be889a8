"""A small Kimi-layout tiktoken tokenizer folder for tests: the files and fields a Kimi-K2 / K2.5 checkpoint ships.

``tiktoken.model`` holds the 256 single bytes (ranks 0–255, byte order) and then merges: for every word of
:data:`WORDS` (ASCII, Chinese, emoji), each byte prefix of length ≥ 2 in order, so BPE reaches the whole word and
many tokens end inside a multi-byte character; ``vocab_size`` pads with two-byte filler tokens. Special tokens
sit at the same offsets above the ranks as in Kimi (``[BOS]`` +0, ``[EOS]`` +1, ``<|im_end|>`` +2, …,
``<|im_middle|>`` +17, ``<think>`` +22, ``[UNK]`` +254, ``[PAD]`` +255), with 256 reserved ids in all.
``tokenizer_config.json`` carries ``added_tokens_decoder`` and Kimi's ``auto_map`` (no Python module is written);
the chat template goes to ``chat_template.jinja`` or to the config's ``chat_template``.
"""

from __future__ import annotations

import base64
from pathlib import Path

from splitspec.files import atomic_dir, write_atomic, write_json

#: Words whose byte prefixes become merges (each reachable by BPE from single bytes).
WORDS = ("hello", " world", " the", "Hello", " token", "你好", "世界", "中文字符", "模型", "😀", "🚀🚀", "ok")
#: Special tokens at their Kimi offsets above the BPE ranks: (offset, content, special).
KIMI_SPECIALS = ((0, "[BOS]", True), (1, "[EOS]", True), (2, "<|im_end|>", True), (3, "<|im_user|>", True),
                 (4, "<|im_assistant|>", True), (6, "<|start_header_id|>", True), (7, "<|end_header_id|>", True),
                 (9, "[EOT]", True), (10, "<|im_system|>", True), (11, "<|tool_calls_section_begin|>", False),
                 (12, "<|tool_calls_section_end|>", False), (13, "<|tool_call_begin|>", False),
                 (14, "<|tool_call_argument_begin|>", False), (15, "<|tool_call_end|>", False),
                 (17, "<|im_middle|>", True), (22, "<think>", True), (23, "</think>", True),
                 (254, "[UNK]", True), (255, "[PAD]", True))
RESERVED = 256

#: A Kimi-style chat template (system default, optional tool list, one block per message).
KIMI_STYLE_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}\n"
    "{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}\n"
    "<|im_system|>system<|im_middle|>You are Kimi, a helpful assistant.<|im_end|>\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "{%- set role = message['role'] -%}\n"
    "<|im_{{ role }}|>{{ message.get('name', role) }}<|im_middle|>{{ message['content'] }}<|im_end|>\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def tiktoken_ranks(vocab_size: int | None = None) -> dict[bytes, int]:
    """The fixture's BPE ranks: bytes, then word-prefix merges, then (to reach ``vocab_size − 256`` ranks) fillers."""
    ranks = {bytes([b]): b for b in range(256)}
    for word in WORDS:
        raw = word.encode("utf-8")
        for n in range(2, len(raw) + 1):
            ranks.setdefault(raw[:n], len(ranks))
    if vocab_size is not None:
        want = vocab_size - RESERVED
        if want < len(ranks):
            raise ValueError(f"vocab_size {vocab_size} leaves fewer than {len(ranks)} ranks")
        pairs = (bytes([a, b]) for a in range(0x21, 0x7F) for b in range(0x21, 0x7F))
        while len(ranks) < want:
            ranks.setdefault(next(pairs), len(ranks))
    return ranks


def write_tiktoken_folder(out: Path, vocab_size: int | None = None, template_in: str = "jinja",
                          template: str = KIMI_STYLE_TEMPLATE, ranks: dict[bytes, int] | None = None) -> Path:
    """Write ``tiktoken.model``, ``tokenizer_config.json``, ``generation_config.json`` (and
    ``chat_template.jinja`` when ``template_in`` is "jinja"; "config" puts it in the config) to ``out``.

    Returns ``out``; its vocabulary has ``vocab_size`` ids (default: the words' merges + 256 specials), or
    ``len(ranks) + 256`` with ``ranks`` given (token bytes → rank, ranks 0 … n−1) instead of the fixture's own.
    """
    ranks = tiktoken_ranks(vocab_size) if ranks is None else ranks
    n = len(ranks)
    added = {str(n + off): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": special} for off, c, special in KIMI_SPECIALS}
    config = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
              "unk_token": "[UNK]", "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                                                                  "<|im_system|>", "<|im_middle|>"],
              "model_max_length": 1048576, "tokenizer_class": "TikTokenTokenizer",
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    if template_in == "config":
        config["chat_template"] = template
    lines = b"".join(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n" for tok, rank in ranks.items())
    with atomic_dir(Path(out)) as tmp:
        write_atomic(tmp / "tiktoken.model", lines)
        write_json(config, tmp / "tokenizer_config.json")
        write_json({"eos_token_id": n + 2}, tmp / "generation_config.json")
        if template_in == "jinja":
            write_atomic(tmp / "chat_template.jinja", template.encode("utf-8"))
    return Path(out)
