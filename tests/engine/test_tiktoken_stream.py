"""The engine streams whole characters with a Kimi-layout tiktoken tokenizer of its vocabulary size.

The demo engine emits whatever ids it emits; the tokenizer is written after seeing them so that every generated
token closes one CJK character and opens the next (bytes: two UTF-8 continuation bytes, then a lead byte). Every
token boundary — inside a cycle and between cycles — then cuts a character, the hardest case for streaming."""

from __future__ import annotations

from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.runtime.types import Request
from splitspec.settings import ServeConfig
from splitspec.testing.tiktoken_fixture import RESERVED, write_tiktoken_folder

PROMPT = [17, 300, 42, 1000, 7, 250, 99, 12]
MAX_TOKENS = 16


def _straddling_ranks(generated: list[int], n_base: int) -> dict[bytes, int]:
    """``n_base`` ranks in which each generated id (below n_base) is ``[continuation, continuation, 0xE4]`` and every
    other id a distinct 3-byte filler starting with 0x00."""
    pieces = {}
    for i in dict.fromkeys(t for t in generated if t < n_base):
        j = len(pieces)
        pieces[i] = bytes([0x80 + j % 64, 0x80 + j // 64 % 64, 0xE4])
    return {pieces.get(i, b"\x00" + i.to_bytes(2, "big")): i for i in range(n_base)}


def test_streamed_text_never_splits_a_character(engines_for, tmp_path):
    with SpeculativeEngine.load(ServeConfig(engines_for(1), num_draft_tokens=3), tokenizer_dir=tmp_path / "none") as eng:
        assert eng.tokenizer is None
        generated = eng.generate(PROMPT, MAX_TOKENS, stop_token_ids=set()).token_ids
        vocab = eng.vocab_size
        folder = write_tiktoken_folder(tmp_path / "tok", ranks=_straddling_ranks(generated, vocab - RESERVED))
        tok = ChatTokenizer.from_dir(folder)
        assert tok.vocab_size == vocab
        eng.tokenizer = tok
        deltas: list[str] = []
        eng.submit(Request(PROMPT, MAX_TOKENS, stop_token_ids=set()), lambda e: deltas.append(e.text))
        while eng.has_work():
            eng.step()
    text = tok.decode(generated)
    kept = sum(1 for t in generated if t < vocab - RESERVED)
    assert kept >= 4, "the engine should emit some BPE tokens"
    # two orphan continuation bytes, then one character per later token, then a lone lead byte
    assert text[:2] == "\ufffd\ufffd" and text[-1] == "\ufffd" and len(text) == 2 + (kept - 1) + 1
    assert all("\u4000" <= c <= "\u4fff" for c in text[2:-1])
    assert "".join(deltas) == text
    # before the end every delta stops at a whole character: the pending lead byte is never released as U+FFFD
    released = [d for d in deltas[:-1] if d]
    assert len(released) >= 2 and all("\u4000" <= d[-1] <= "\u4fff" for d in released)
    assert "".join(released).count("\ufffd") == 2 and deltas[-1].endswith("\ufffd")
