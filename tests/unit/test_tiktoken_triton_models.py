"""The repository's preprocessing and postprocessing Triton models serve a Kimi tiktoken tokenizer folder as they
serve the demo's tokenizer.json: run in-process against the stand-in ``triton_python_backend_utils``, Chinese and
emoji prompts become the tokenizer's ids (chat template included) and ids come back as the same UTF-8 text."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from test_triton_adapter import _Request, pb  # noqa: F401  (the stand-in pb_utils fixture and its request)

from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.testing.tiktoken_fixture import write_tiktoken_folder

REPO = Path(__file__).resolve().parents[2] / "triton_repo"
PROMPT = "你好，世界！😀 写一个中文字符🚀"


def _model(name: str, folder: Path, **params):
    spec = importlib.util.spec_from_file_location(f"{name}_model_under_test", REPO / name / "1" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m = mod.TritonPythonModel()
    values = {"tokenizer_dir": str(folder), "max_prompt_bytes": "65536"} | params
    m.initialize({"model_config": json.dumps({"name": name, "parameters": {k: {"string_value": v} for k, v in values.items()}})})
    return m


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiktoken_folder(tmp_path_factory.mktemp("kimi") / "tok")


@pytest.mark.usefixtures("pb")
def test_preprocessing_and_postprocessing_serve_a_tiktoken_folder(folder):
    tok = ChatTokenizer.from_dir(folder)
    pre, post = _model("preprocessing", folder, trust_remote_code="0"), _model("postprocessing", folder)
    raw = np.array([[PROMPT.encode("utf-8")]], dtype=np.object_)  # [1, 1]: batched like the ensemble
    (plain, chat) = (pre.execute([_Request(text_input=raw, apply_chat_template=np.array([[c]]))])[0] for c in (False, True))
    assert plain.error is None and plain.output_tensors[0].array.tolist() == [tok.encode(PROMPT)]
    want = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    assert chat.output_tensors[0].array.tolist() == [want] and tok.im_end_id in want  # specials as single ids
    out = post.execute([_Request(output_ids=np.array([tok.encode(PROMPT) + [tok.im_end_id]], dtype=np.int32))])[0]
    assert out.error is None and out.output_tensors[0].array.tolist() == [PROMPT.encode("utf-8")]


@pytest.mark.usefixtures("pb")
def test_a_python_only_tokenizer_fails_the_model_load(folder, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}))
    with pytest.raises(Exception, match="names Python code.*--trust-remote-code"):
        _model("preprocessing", tmp_path)
    with pytest.raises(Exception, match="parameter 'trust_remote_code' = 'yes please'"):
        _model("postprocessing", folder, trust_remote_code="yes please")


def _engines(tmp_path: Path) -> Path:
    eng = tmp_path / "engines"
    write_tiktoken_folder(eng / "target")
    for kind in ("target", "drafter"):
        (eng / kind).mkdir(parents=True, exist_ok=True)
        (eng / kind / "engine.json").write_text(json.dumps({"kind": kind, "mapping": {"tp_size": 1},
                                                            "limits": {"max_draft_len": 8, "max_seq_len": 256}}))
    return eng


def test_repository_renders_for_a_tiktoken_target_and_refuses_python_only(tmp_path):
    from splitspec.errors import ConfigError
    from splitspec.serving.repo import render_repo, repo_setting
    from splitspec.settings import ServeConfig

    eng = _engines(tmp_path)
    repo = render_repo(ServeConfig(eng, num_draft_tokens=2), tmp_path / "repo")
    for model in ("preprocessing", "postprocessing", "spec_decode"):
        assert repo_setting(repo, model, "trust_remote_code") == "0"
    assert repo_setting(repo, "preprocessing", "tokenizer_dir") == str(eng.resolve() / "target")
    (eng / "target" / "tiktoken.model").unlink()  # left: tokenizer_config.json, whose auto_map names Kimi's module
    with pytest.raises(ConfigError, match="no tokenizer.json or tiktoken.model.*tokenization_kimi.*--trust-remote-code"):
        render_repo(ServeConfig(eng, num_draft_tokens=2), tmp_path / "repo2")
    assert not (tmp_path / "repo2").exists()
    repo = render_repo(ServeConfig(eng, num_draft_tokens=2, trust_remote_code=True), tmp_path / "repo3")
    assert repo_setting(repo, "postprocessing", "trust_remote_code") == "1"
