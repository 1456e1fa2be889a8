"""A served request through the ensemble with a Kimi-layout tiktoken tokenizer (tiktoken.model +
tokenizer_config.json, no tokenizer.json): the demo TP1 engines with their tokenizer replaced by one of the same
vocabulary size whose pieces are whole and split CJK characters and emoji, so that the engine's tokens cut
characters. Streamed over HTTP SSE and gRPC, the text arrives as whole characters: the chunks join to the
non-streamed text, which is the tokenizer's own decoding of the output ids."""

from __future__ import annotations

import shutil

import pytest

from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.serving.client import ask_http, stream_grpc, stream_http
from splitspec.testing.tiktoken_fixture import RESERVED, write_tiktoken_folder

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

PROMPT = "你好，世界！😀 写一个中文字符🚀"
MAX_TOKENS = 24


def _cjk_emoji_ranks(n: int) -> dict[bytes, int]:
    """The 256 bytes, then whole characters and their 2-byte halves alternating (CJK from U+4E00, emoji from
    U+1F600), up to ``n`` ranks."""
    ranks = {bytes([b]): b for b in range(256)}
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + n)]
    emoji = [chr(c) for c in range(0x1F600, 0x1F650)]
    for i, c in enumerate(chars):
        for piece in ((emoji[i % len(emoji)].encode(),) if i % 5 == 0 else ()) + (c.encode(), c.encode()[:2], c.encode()[1:]):
            if len(ranks) < n:
                ranks.setdefault(piece, len(ranks))
        if len(ranks) >= n:
            break
    return ranks


@pytest.fixture(scope="module")
def server(engines_for, tmp_path_factory):
    from splitspec.files import read_json
    from splitspec.serving.repo import render_repo
    from splitspec.serving.tritonserver import TritonServer
    from splitspec.settings import ServeConfig

    eng = tmp_path_factory.mktemp("tiktoken") / "engines"
    shutil.copytree(engines_for(1), eng)
    target = eng / "target"
    vocab = read_json(target / "engine.json")["config"]["vocab_size"]
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (target / f).unlink(missing_ok=True)
    tok_dir = write_tiktoken_folder(eng.parent / "tok", ranks=_cjk_emoji_ranks(vocab - RESERVED))
    for f in tok_dir.iterdir():
        shutil.copy(f, target / f.name)
    tok = ChatTokenizer.from_dir(target)
    assert tok.vocab_size == vocab and not (target / "tokenizer.json").exists()
    repo = render_repo(ServeConfig(eng, num_draft_tokens=3), tmp_path_factory.mktemp("tiktoken_repo") / "repo")
    with TritonServer(repo, exit_timeout_s=10, startup_timeout_s=300) as srv:
        yield srv, tok


def test_streams_whole_characters_through_every_door(server):
    srv, tok = server
    full = ask_http(srv.generate_url, PROMPT, max_tokens=MAX_TOKENS, return_token_ids=True)
    ids = full["output_ids"]
    assert len(ids) == MAX_TOKENS and full["text_output"] == tok.decode(ids)
    text = full["text_output"]
    assert sum("\u4e00" <= c <= "\u9fff" or c >= "\U0001f600" for c in text) >= 4, text  # the pieces are CJK / emoji
    sse = [e["text_output"] for e in stream_http(srv.generate_stream_url, PROMPT, max_tokens=MAX_TOKENS)]
    grpc = [r["text_output"] for r in stream_grpc(srv.grpc_address, PROMPT, max_tokens=MAX_TOKENS)]
    for chunks in (sse, grpc):
        assert len(chunks) > 2 and "".join(chunks) == text
        # a chunk never ends inside a character: no replacement character appears that the whole text lacks
        assert sum(c.count("\ufffd") for c in chunks) == text.count("\ufffd")
