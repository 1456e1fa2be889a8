"""Demo checkpoints and tokenizer: formats, determinism, and agreement with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from splitspec.demo.pair import make_demo_models
from splitspec.demo.corpus import stdlib_corpus
from splitspec.demo.tokenizer_train import count_token_frequencies, train_tokenizer
from splitspec.errors import CheckpointError
from splitspec.files import read_json
from splitspec.runtime.tokenizer import SPECIAL_TOKENS, ChatTokenizer
from splitspec.testing.reference import load_hf_reference_target

VOCAB = 4096
N_SPECIAL = len(SPECIAL_TOKENS)
BOS, EOS, IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE, UNK, PAD = range(VOCAB - N_SPECIAL, VOCAB)
BF16, F32 = torch.bfloat16, torch.float32

#: The demo target's config.json: Kimi-K2-Instruct's as published (tests/fixtures/published), at toy size, without
#: the fields of its quantisation, remote code and training, and with a [PAD] id.
KIMI_K2 = read_json(Path(__file__).parents[1] / "fixtures" / "published" / "kimi-k2-instruct" / "config.json")
NOT_CARRIED = ("auto_map", "aux_loss_alpha", "num_nextn_predict_layers", "pretraining_tp", "quantization_config",
               "seq_aux", "transformers_version")
TOY_SIZE = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
            "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 16,
            "num_experts_per_tok": 4, "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16, "v_head_dim": 32, "max_position_embeddings": 4096,
            "rope_scaling": KIMI_K2["rope_scaling"] | {"factor": 8.0, "original_max_position_embeddings": 512},
            "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
EXPECTED_TARGET_CONFIG = {k: v for k, v in KIMI_K2.items() if k not in NOT_CARRIED} | TOY_SIZE

EXPECTED_DRAFTER_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
    "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32,
    "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": 4096, "draft_vocab_size": 1024,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "rope_scaling": None, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": BOS, "eos_token_id": EOS,
    "target_hidden_size": 256,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4], "aux_layer_id_convention": "input",
                     "use_aux_hidden_state": True},
}


def expected_target_tensors() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    t: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "model.embed_tokens.weight": ((4096, 256), BF16),
        "model.norm.weight": ((256,), BF16),
        "lm_head.weight": ((4096, 256), BF16),
    }
    for n in range(5):
        p = f"model.layers.{n}"
        t.update({
            f"{p}.input_layernorm.weight": ((256,), BF16),
            f"{p}.post_attention_layernorm.weight": ((256,), BF16),
            f"{p}.self_attn.q_a_proj.weight": ((96, 256), BF16),
            f"{p}.self_attn.q_a_layernorm.weight": ((96,), BF16),
            f"{p}.self_attn.q_b_proj.weight": ((8 * (32 + 16), 96), BF16),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": ((64 + 16, 256), BF16),
            f"{p}.self_attn.kv_a_layernorm.weight": ((64,), BF16),
            f"{p}.self_attn.kv_b_proj.weight": ((8 * (32 + 32), 64), BF16),
            f"{p}.self_attn.o_proj.weight": ((256, 8 * 32), BF16),
        })
        if n == 0:
            t.update({f"{p}.mlp.gate_proj.weight": ((768, 256), BF16),
                      f"{p}.mlp.up_proj.weight": ((768, 256), BF16),
                      f"{p}.mlp.down_proj.weight": ((256, 768), BF16)})
            continue
        t[f"{p}.mlp.gate.weight"] = ((16, 256), BF16)
        t[f"{p}.mlp.gate.e_score_correction_bias"] = ((16,), F32)
        for e in [*(f"experts.{i}" for i in range(16)), "shared_experts"]:
            t.update({f"{p}.mlp.{e}.gate_proj.weight": ((128, 256), BF16),
                      f"{p}.mlp.{e}.up_proj.weight": ((128, 256), BF16),
                      f"{p}.mlp.{e}.down_proj.weight": ((256, 128), BF16)})
    return t


EXPECTED_DRAFTER_TENSORS = {
    "midlayer.self_attn.q_proj.weight": ((256, 512), BF16),
    "midlayer.self_attn.k_proj.weight": ((256, 512), BF16),
    "midlayer.self_attn.v_proj.weight": ((256, 512), BF16),
    "midlayer.self_attn.o_proj.weight": ((256, 256), BF16),
    "midlayer.mlp.gate_proj.weight": ((768, 256), BF16),
    "midlayer.mlp.up_proj.weight": ((768, 256), BF16),
    "midlayer.mlp.down_proj.weight": ((256, 768), BF16),
    "midlayer.input_layernorm.weight": ((256,), BF16),
    "midlayer.hidden_norm.weight": ((256,), BF16),
    "midlayer.post_attention_layernorm.weight": ((256,), BF16),
    "fc.weight": ((256, 768), BF16),
    "norm.weight": ((256,), BF16),
    "lm_head.weight": ((1024, 256), BF16),
    "d2t": ((1024,), torch.int64),
    "t2d": ((4096,), torch.bool),
}


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            assert sf.metadata() == {"format": "pt"}, f
            for k in sf.keys():
                assert k not in out, f"{k} stored twice"
                out[k] = sf.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def demo(demo_models) -> Path:
    """The session's demo models (tests/conftest.py: ``make_demo_models(out, seed=0)``), written once for every module."""
    return demo_models


@pytest.fixture(scope="module")
def tok(demo) -> ChatTokenizer:
    return ChatTokenizer.from_dir(demo / "target")


@pytest.fixture(scope="module")
def target_tensors(demo) -> dict[str, torch.Tensor]:
    return read_all(demo / "target")


@pytest.fixture(scope="module")
def drafter_tensors(demo) -> dict[str, torch.Tensor]:
    return read_all(demo / "drafter")


# ---------------------------------------------------------------------------- layout


def test_folder_layout(demo):
    assert sorted(p.name for p in demo.iterdir()) == ["README.md", "drafter", "target"]
    assert sorted(p.name for p in (demo / "target").iterdir()) == sorted([
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"])
    assert sorted(p.name for p in (demo / "drafter").iterdir()) == ["config.json", "model.safetensors"]
    assert "random" in (demo / "README.md").read_text()
    assert not list(demo.parent.glob(f".{demo.name}.*")), "temporary folders left behind"


def test_target_config(demo):
    cfg = json.loads((demo / "target" / "config.json").read_text())
    assert cfg == EXPECTED_TARGET_CONFIG
    gen = json.loads((demo / "target" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [EOS, IM_END]


def test_drafter_config(demo):
    assert json.loads((demo / "drafter" / "config.json").read_text()) == EXPECTED_DRAFTER_CONFIG


def test_target_tensors(target_tensors):
    expected = expected_target_tensors()
    assert sorted(target_tensors) == sorted(expected)
    for name, (shape, dtype) in expected.items():
        t = target_tensors[name]
        assert tuple(t.shape) == shape and t.dtype == dtype, (name, t.shape, t.dtype)
    n_params = sum(t.numel() for t in target_tensors.values())
    print(f"target parameters: {n_params:,}")
    assert n_params <= 20_000_000
    # norms are 1 + noise, the correction bias is non-zero
    norm = target_tensors["model.layers.0.input_layernorm.weight"].float()
    assert 0.9 < norm.mean() < 1.1 and norm.std() > 0.01
    assert target_tensors["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0


def test_target_index(demo, target_tensors):
    index = json.loads((demo / "target" / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    assert sorted(wm) == sorted(target_tensors)
    assert set(wm.values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    for fname in set(wm.values()):
        with safe_open(str(demo / "target" / fname), framework="pt") as sf:
            assert sorted(sf.keys()) == sorted(k for k, v in wm.items() if v == fname)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in target_tensors.values())
    # layers split roughly in half, each layer in one file
    for n in range(5):
        files = {v for k, v in wm.items() if k.startswith(f"model.layers.{n}.")}
        assert len(files) == 1, n


def test_drafter_tensors_and_vocab(drafter_tensors, tok, demo):
    assert sorted(drafter_tensors) == sorted(EXPECTED_DRAFTER_TENSORS)
    for name, (shape, dtype) in EXPECTED_DRAFTER_TENSORS.items():
        t = drafter_tensors[name]
        assert tuple(t.shape) == shape and t.dtype == dtype, (name, t.shape, t.dtype)
    d2t, t2d = drafter_tensors["d2t"], drafter_tensors["t2d"]
    target_ids = torch.arange(1024) + d2t
    assert 1024 < VOCAB
    assert bool((target_ids >= 0).all()) and bool((target_ids < VOCAB).all())
    assert bool((target_ids[1:] > target_ids[:-1]).all()), "draft vocabulary must be sorted and distinct"
    assert int(t2d.sum()) == 1024
    assert bool(t2d[target_ids].all())
    assert t2d[EOS] and t2d[IM_END]
    # the most frequent tokens of the corpus, ties by lower id
    counts = count_token_frequencies(tok, stdlib_corpus())
    chosen = target_ids.numpy()
    rest = np.setdiff1d(np.arange(VOCAB), chosen)
    free = np.setdiff1d(chosen, [EOS, IM_END])
    assert counts[free].min() >= counts[rest].max()


def test_deterministic(demo, target_tensors, drafter_tensors, tmp_path, monkeypatch):
    other = tmp_path / "again"
    make_demo_models(other, seed=0)
    for sub in ("target", "drafter"):
        for f in (demo / sub).glob("*.json"):  # tokenizer.json too: a second training gives the same bytes
            assert (other / sub / f.name).read_bytes() == f.read_bytes(), f.name
    for mine, theirs in ((target_tensors, read_all(other / "target")), (drafter_tensors, read_all(other / "drafter"))):
        assert sorted(mine) == sorted(theirs)
        for k in mine:
            assert torch.equal(mine[k], theirs[k]), k
    # an existing folder is replaced; another seed gives other weights. The tokenizer does not depend on the seed
    # (checked above and in test_tokenizer_training_deterministic): this time its files are copied, not trained again
    assert "train_tokenizer" in make_demo_models.__globals__

    def copy_tokenizer(out_dir, **_):
        for f in (demo / "target").glob("*token*.json"):
            (Path(out_dir) / f.name).write_bytes(f.read_bytes())

    monkeypatch.setitem(make_demo_models.__globals__, "train_tokenizer", copy_tokenizer)
    make_demo_models(other, seed=1)
    w = read_all(other / "target")["lm_head.weight"]
    assert not torch.equal(w, target_tensors["lm_head.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


# ---------------------------------------------------------------------------- tokenizer


def test_tokenizer_training_deterministic(demo, tmp_path):
    """A training on its own gives the bytes of the demo's (trained inside make_demo_models)."""
    train_tokenizer(tmp_path / "a")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (demo / "target" / "tokenizer.json").read_bytes()


def test_special_tokens_at_end(tok):
    assert tok.vocab_size == VOCAB and VOCAB % 8 == 0
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(VOCAB - N_SPECIAL, VOCAB))
    assert (tok.bos_token_id, tok.eos_token_id, tok.im_end_id) == (BOS, EOS, IM_END)
    assert tok.stop_token_ids == [EOS, IM_END]


@pytest.mark.parametrize("text", [
    "def f(x):\n    return x ** 2  # square\n",
    "naïve — 你好 🙂",
    "  leading spaces, tabs\tand\r\nCRLF; emoji 👩‍💻 and combining e\u0301",
])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < VOCAB - N_SPECIAL for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_in_text(tok):
    ids = tok.encode("a<|im_end|>b")
    assert IM_END in ids
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "a<|im_end|>b"


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2?"}]
    default_sys = "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>"
    body = ("<|im_user|>user<|im_middle|>Hi<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>"
            "<|im_user|>user<|im_middle|>2+2?<|im_end|>")
    gen = "<|im_assistant|>assistant<|im_middle|>"
    assert tok.apply_chat_template(msgs) == default_sys + body + gen
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == default_sys + body
    with_sys = [{"role": "system", "content": "Be brief."}] + msgs
    assert tok.apply_chat_template(with_sys) == "<|im_system|>system<|im_middle|>Be brief.<|im_end|>" + body + gen
    ids = tok.encode(tok.apply_chat_template(msgs))
    assert ids[0] == tok.token_to_id("<|im_system|>") and ids[-1] == IM_MIDDLE


def test_tokenizer_errors(tmp_path, demo):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        ChatTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((demo / "target" / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        ChatTokenizer.from_dir(tmp_path)


@pytest.fixture(scope="module")
def hf_tokenizers(demo, tmp_path_factory):
    """transformers' view of the tokenizer files: AutoTokenizer on a tokenizer-only folder, and the
    class named in tokenizer_config.json on target/ itself. (AutoTokenizer on target/ first reads
    config.json, whose model_type kimi_k2 transformers does not know; its generic-config fallback
    then fails on the YaRN rope_scaling, as it does for the published Kimi-K2 without remote code.)"""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    only = tmp_path_factory.mktemp("tokenizer_only")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (only / name).write_bytes((demo / "target" / name).read_bytes())
    return [AutoTokenizer.from_pretrained(str(only)), PreTrainedTokenizerFast.from_pretrained(str(demo / "target"))]


@pytest.mark.parametrize("which", [0, 1], ids=["AutoTokenizer", "PreTrainedTokenizerFast"])
def test_transformers_tokenizer_agrees(hf_tokenizers, tok, which):
    hf = hf_tokenizers[which]
    assert len(hf) == VOCAB
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (BOS, EOS, PAD, UNK)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve — 你好 🙂"}]
    for m in (msgs, msgs[1:]):
        text = hf.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        assert text == tok.apply_chat_template(m)
        assert hf(text)["input_ids"] == tok.encode(text)
    for text in ("import os\nprint(os.getcwd())", "naïve — 你好 🙂"):
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids) == text


# ---------------------------------------------------------------------------- transformers reference


def test_transformers_loads_target(demo, target_tensors, tok):
    model = load_hf_reference_target(demo / "target", dtype=torch.float32)
    cfg = model.config
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 8.0
    # per-expert tensors were stacked into transformers' fused layout, not left random
    experts = model.model.layers[1].mlp.experts
    gate = target_tensors["model.layers.1.mlp.experts.5.gate_proj.weight"].float()
    up = target_tensors["model.layers.1.mlp.experts.5.up_proj.weight"].float()
    assert torch.equal(experts.gate_up_proj[5], torch.cat([gate, up]))
    assert torch.equal(model.model.layers[2].mlp.gate.e_score_correction_bias,
                       target_tensors["model.layers.2.mlp.gate.e_score_correction_bias"])
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a function that sorts a list."}])
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert logits.shape == (ids.shape[1], VOCAB)
    assert torch.isfinite(logits).all()
    assert logits[-1].std() > 0.5, "logits nearly tied"
