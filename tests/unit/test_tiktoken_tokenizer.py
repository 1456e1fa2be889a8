"""Kimi's tiktoken tokenizer read as data: ids agree token for token with a tiktoken encoding built here
independently, text round-trips (ASCII, Chinese, emoji), special tokens sit where Kimi puts them, the chat template
renders as transformers renders it, streamed decoding never breaks a character, and bad folders get one-line errors."""

from __future__ import annotations

import re

import hashlib
import itertools
import json

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from splitspec.errors import CheckpointError
from splitspec.runtime.detok import IncrementalDetokenizer
from splitspec.runtime.tiktoken_folder import KIMI_PAT_STR, split_long_runs
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.testing.tiktoken_fixture import KIMI_SPECIALS, KIMI_STYLE_TEMPLATE, write_tiktoken_folder

#: tokenization_kimi.py's pat_str, transcribed here separately from the library's constant.
REFERENCE_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

TEXTS = ["hello world", "Hello, the token world!", "你好，世界！中文字符模型", "😀 🚀🚀 ok", "丸子 and 中文",
         "I'm sure they'LL say DON'T 12345 6.02e23", "  lots   of\n\n spaces\t\r\nhere  ", "ASCII 你好😀mixed世界🚀",
         "<|im_user|>user<|im_middle|>你好<|im_end|>[EOS]", "<think>模型</think>", ""]
STREAM_TEXT = "你好，世界！😀 丸中文字符🚀🚀 ok"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiktoken_folder(tmp_path_factory.mktemp("kimi") / "tok")


@pytest.fixture(scope="module")
def tok(folder):
    return ChatTokenizer.from_dir(folder)


@pytest.fixture(scope="module")
def reference(folder):
    """tiktoken's own reader (with the file's hash, so its path cache cannot serve a stale copy) and Encoding."""
    path = folder / "tiktoken.model"
    ranks = load_tiktoken_bpe(str(path), expected_hash=hashlib.sha256(path.read_bytes()).hexdigest())
    added = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    named = {int(k): v["content"] for k, v in added.items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), len(ranks) + 256)}
    return tiktoken.Encoding("reference", pat_str=REFERENCE_PAT, mergeable_ranks=ranks, special_tokens=specials)


def test_pattern_is_kimis():
    assert KIMI_PAT_STR == REFERENCE_PAT


@pytest.mark.parametrize("text", TEXTS)
def test_ids_agree_with_reference_and_round_trip(tok, reference, text):
    ids = tok.encode(text)
    assert ids == reference.encode(text, allowed_special="all")
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_chinese_and_emoji_use_merges(tok):
    for word in ("你好", "世界", "中文字符", "😀"):
        assert len(tok.encode(word)) == 1, word  # one merged token, not bytes
    assert tok.decode(tok.encode("丸")[:1]) == "\ufffd"  # a token that ends inside a character


def test_special_tokens_at_kimis_offsets(tok, folder):
    n = tok.vocab_size - 256
    for off, content, _ in KIMI_SPECIALS:
        assert tok.token_to_id(content) == n + off and tok.encode(content) == [n + off]
    assert tok.encode("<|reserved_token_%d|>" % (n + 5)) == [n + 5]
    assert (tok.bos_token_id, tok.eos_token_id, tok.im_end_id) == (n, n + 1, n + 2)
    assert tok.stop_token_ids == [n + 1, n + 2]  # [EOS], <|im_end|> (generation_config's eos_token_id: <|im_end|>)
    ids = tok.encode("<|tool_call_begin|>hi<|im_end|><|reserved_token_%d|>" % (n + 5))
    assert tok.decode(ids) == "<|tool_call_begin|>hi"  # "special": false stays; specials and reserved ones go


def test_long_runs_are_cut_like_kimi(tok):
    pieces = list(split_long_runs("x" * 60_000 + " " * 30_000 + "y", 25_000))
    assert "".join(pieces) == "x" * 60_000 + " " * 30_000 + "y" and len(pieces) == 4
    assert max(len(list(run)) for p in pieces for _, run in itertools.groupby(p, str.isspace)) == 25_000
    text = "你" * 30_000
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_renders_as_transformers(tok):
    from transformers.utils.chat_template_utils import render_jinja_template

    for messages in ([{"role": "user", "content": "你好 😀"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "世界"}, {"role": "user", "content": "ok"}]):
        for gen in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
            theirs = render_jinja_template([messages], chat_template=KIMI_STYLE_TEMPLATE, add_generation_prompt=gen,
                                           bos_token="[BOS]", eos_token="[EOS]")[0][0]
            assert ours == theirs
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "你好"}]))
    n = tok.vocab_size - 256
    assert ids[0] == n + 10 and ids.count(n + 17) == 3 and ids[-1] == n + 17  # <|im_system|>, 3 × <|im_middle|>


def test_chat_template_jinja_file_wins_over_config(tmp_path):
    folder = write_tiktoken_folder(tmp_path / "tok", template_in="config", template="CONFIG {{ messages[0]['content'] }}")
    (folder / "chat_template.jinja").write_text("FILE {{ messages[0]['content'] }}")
    assert ChatTokenizer.from_dir(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "FILE x"
    (folder / "chat_template.jinja").unlink()
    assert ChatTokenizer.from_dir(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "CONFIG x"


def _stream(tok, chunks):
    detok = IncrementalDetokenizer(tok.decode)
    deltas = [detok.add(c) for c in chunks[:-1]] + [detok.add(chunks[-1], final=True)]
    return deltas


def test_streamed_decode_never_breaks_a_character(tok):
    raw = STREAM_TEXT.encode("utf-8")
    byte_ids = list(raw)  # ranks 0-255 are the single bytes
    for k in range(1, len(raw)):  # two chunks split at every byte boundary
        deltas = _stream(tok, [byte_ids[:k], byte_ids[k:]])
        assert "".join(deltas) == STREAM_TEXT and "\ufffd" not in "".join(deltas), k
        assert STREAM_TEXT.encode("utf-8").startswith(deltas[0].encode("utf-8"))
    deltas = _stream(tok, [[b] for b in byte_ids])  # one byte at a time
    assert "".join(deltas) == STREAM_TEXT and all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d) == len(STREAM_TEXT)  # each character released once, when complete
    ids = tok.encode(STREAM_TEXT)  # the real encoding, token by token (some tokens end inside a character)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    assert "".join(_stream(tok, [[i] for i in ids])) == STREAM_TEXT


def _one_line_error(folder, match, **kw):
    with pytest.raises(CheckpointError, match=match) as e:
        ChatTokenizer.from_dir(folder, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_folders_get_one_line_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(empty, r"empty: no tokenizer: neither tokenizer.json nor tiktoken.model")

    folder = write_tiktoken_folder(tmp_path / "tok")
    lines = (folder / "tiktoken.model").read_bytes().splitlines()
    (folder / "tiktoken.model").write_bytes(b"\n".join(lines[:2] + [b"not-base64! 2"] + lines[3:]))
    _one_line_error(folder, r"tiktoken.model: line 3: .*not 'base64-token rank'")
    (folder / "tiktoken.model").write_bytes(b"\n".join(lines[:3] + [lines[3].split()[0] + b" 1"] + lines[4:]))
    _one_line_error(folder, r"tiktoken.model: line 4: rank 1 listed twice \(also on line 2\)")
    (folder / "tiktoken.model").write_bytes(b"\n".join(lines))

    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(cfg | {"added_tokens_decoder": cfg["added_tokens_decoder"] | {"5": {"content": "<x>"}}}))
    _one_line_error(folder, r"tokenizer_config.json: added_tokens_decoder\['5'\] = '<x>': id 5 collides with a BPE rank")
    cfg_path.write_text(json.dumps({k: v for k, v in cfg.items() if k != "added_tokens_decoder"}))
    _one_line_error(folder, r"tokenizer_config.json: field 'added_tokens_decoder' missing")
    cfg_path.write_text("{not json")
    _one_line_error(folder, r"tokenizer_config.json: not valid JSON")
    cfg_path.unlink()
    _one_line_error(folder, r"tokenizer_config.json: file not found")


def test_python_only_tokenizer_is_refused_without_trust_remote_code(tmp_path, monkeypatch):
    """A folder whose tokenizer is only Python code is data, refused by default; the opt-in runs it through
    transformers' AutoTokenizer (here a tiny module over a tokenizers file under another name)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "remote"
    folder.mkdir()
    vocab = {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "[UNK]": 3, "hello": 4, "world": 5}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["[BOS]", "[EOS]", "<|im_end|>"])
    t.save(str(folder / "my_tok.json"))
    (folder / "tokenization_mytok.py").write_text(
        "from tokenizers import Tokenizer\nfrom transformers import PreTrainedTokenizerFast\n\n\n"
        "class MyTok(PreTrainedTokenizerFast):\n    vocab_files_names = {'vocab_file': 'my_tok.json'}\n\n"
        "    def __init__(self, vocab_file=None, **kw):\n"
        "        super().__init__(tokenizer_object=Tokenizer.from_file(vocab_file), **kw)\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": [None, "tokenization_mytok.MyTok"]}, "tokenizer_class": "MyTok",
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "chat_template": "{{ messages[0]['content'] }}"}))
    msg = _one_line_error(folder, r"'auto_map.AutoTokenizer' = 'tokenization_mytok.MyTok' names Python code")
    assert "--trust-remote-code" in msg and "data" in msg
    monkeypatch.setattr("transformers.dynamic_module_utils.HF_MODULES_CACHE", str(tmp_path / "modules"))
    tok = ChatTokenizer.from_dir(folder, trust_remote_code=True)
    assert (tmp_path / "modules").is_dir()  # transformers copied the module there to import it
    assert tok.encode("hello world") == [4, 5] and tok.decode([0, 4, 5, 2]) == "hello world"
    assert tok.stop_token_ids == [1, 2] and tok.vocab_size == 6


def test_conversion_carries_the_tokenizer_files(folder, tmp_path):
    from splitspec.convert.pair import tokenizer_files, tokenizer_vocab_size

    (tmp_path / "x").mkdir()
    for f in folder.iterdir():
        (tmp_path / "x" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "x" / "tokenization_kimi.py").write_text("raise SystemExit('never run')\n")
    assert tokenizer_files(tmp_path / "x") == ["tokenizer_config.json", "generation_config.json", "tiktoken.model",
                                              "chat_template.jinja", "tokenization_kimi.py"]
    assert tokenizer_vocab_size(folder) == (ChatTokenizer.from_dir(folder).vocab_size, "tiktoken.model")


@pytest.mark.parametrize("line, expect", [(b"Bg== seven\n", "line 7: b'Bg== seven' is not 'base64-token rank'"),
                                          (b"\xff\xfe 5\n", "line 7:")])
def test_convert_checks_the_ranks_file_before_writing(folder, tmp_path, line, expect):
    """convert reads tiktoken.model as the runtime does: a bad line is a one-line error before anything is written
    (invalid UTF-8 or base64 alike)."""
    from splitspec.convert.pair import tokenizer_vocab_size
    from splitspec.errors import CheckpointError

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    lines = (bad / "tiktoken.model").read_bytes().splitlines(keepends=True)
    (bad / "tiktoken.model").write_bytes(b"".join(lines[:6] + [line] + lines[6:]))
    with pytest.raises(CheckpointError, match="tiktoken.model: " + re.escape(expect)):
        tokenizer_vocab_size(bad)
