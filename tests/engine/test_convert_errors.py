"""Bad checkpoints and bad options get a clear error naming the file, tensor or field, and leave no output."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitspec.build.engines import build_engines
from splitspec.cli import main as cli_main
from splitspec.convert.pair import convert_pair
from splitspec.errors import CheckpointError, ConfigError


@pytest.fixture()
def pair(demo_models, tmp_path):
    shutil.copytree(demo_models / "target", tmp_path / "target")
    shutil.copytree(demo_models / "drafter", tmp_path / "drafter")
    return tmp_path


def _edit_json(path, **changes):
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _assert_nothing_written(root):
    assert not (root / "out").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".out")], "temporary output left behind"


def test_missing_tensor(pair):
    shard = pair / "target" / "model-00002-of-00002.safetensors"
    tensors = load_file(str(shard))
    victim = sorted(k for k in tensors if "kv_b_proj" in k)[0]
    del tensors[victim]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = pair / "target" / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    del idx["weight_map"][victim]
    index.write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=f"tensor '{victim}' is missing"):
        convert_pair(pair / "target", pair / "drafter", pair / "out")
    _assert_nothing_written(pair)


def test_wrong_shape(pair):
    path = pair / "drafter" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["norm.weight"] = tensors["norm.weight"][:-1].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'norm.weight' has shape \[255\], expected \[256\]"):
        convert_pair(pair / "target", pair / "drafter", pair / "out")
    _assert_nothing_written(pair)


def test_drafter_hidden_size_mismatch(pair):
    _edit_json(pair / "drafter" / "config.json", target_hidden_size=512)
    with pytest.raises(CheckpointError, match="target_hidden_size = 512.*hidden_size is 256"):
        convert_pair(pair / "target", pair / "drafter", pair / "out")
    _assert_nothing_written(pair)


def test_tp_not_dividing_heads(pair):
    with pytest.raises(ConfigError, match="num_attention_heads = 8 is not divisible by 3"):
        convert_pair(pair / "target", pair / "drafter", pair / "out", tp_size=3)
    _assert_nothing_written(pair)


def test_aux_layer_out_of_range_and_undeclared_convention(pair):
    cfg = json.loads((pair / "drafter" / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 5]
    cfg["eagle_config"]["aux_layer_id_convention"] = "output"
    (pair / "drafter" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="contains 5, out of range for a 5-layer target"):
        convert_pair(pair / "target", pair / "drafter", pair / "out")
    del cfg["eagle_config"]["aux_layer_id_convention"]
    (pair / "drafter" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="aux_convention is unknown"):
        convert_pair(pair / "target", pair / "drafter", pair / "out")
    _assert_nothing_written(pair)


def test_truncated_shard_and_missing_shard(pair):
    shard = pair / "target" / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        convert_pair(pair / "target", pair / "drafter", pair / "out")
    shard.unlink()
    with pytest.raises(CheckpointError, match="names shard 'model-00001-of-00002.safetensors', which is missing"):
        convert_pair(pair / "target", pair / "drafter", pair / "out")
    _assert_nothing_written(pair)


def test_failed_build_keeps_previous_engine(pair, tmp_path):
    convert_pair(pair / "target", pair / "drafter", tmp_path / "ckpt", tp_size=2)
    build_engines(tmp_path / "ckpt", tmp_path / "eng")
    before = sorted(p.name for p in (tmp_path / "eng" / "target").iterdir())
    (tmp_path / "ckpt" / "target" / "rank1.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rank1.safetensors: shard missing"):
        build_engines(tmp_path / "ckpt", tmp_path / "eng")
    assert sorted(p.name for p in (tmp_path / "eng" / "target").iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".eng")]
    with pytest.raises(ConfigError, match=r"^max_seq_len = 10, expected ≥ max_draft_len \+ 3 = 11"):
        build_engines(tmp_path / "ckpt", tmp_path / "eng", max_seq_len=10)  # no request could be served
    assert sorted(p.name for p in (tmp_path / "eng" / "target").iterdir()) == before


def test_cli_prints_one_line_error(pair, capsys):
    rc = cli_main(["convert", "--target", str(pair / "target"), "--drafter", str(pair / "drafter"), "--out", str(pair / "out"), "--tp", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: " in err and "Traceback" not in err


# ---------------------------------------------------------------- every published form (splitspec.testing.fixtures)

@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    from splitspec.testing.fixtures import make_fixtures

    return make_fixtures(tmp_path_factory.mktemp("forms") / "fixtures")


@pytest.fixture()
def copy_forms(forms, tmp_path):
    """``copy_forms(target_form, drafter_form="drafter")`` → tmp_path with ``target/`` and ``drafter/`` copies."""

    def get(target: str, drafter: str = "drafter"):
        shutil.copytree(forms / target, tmp_path / "target")
        shutil.copytree(forms / drafter, tmp_path / "drafter")
        return tmp_path

    return get


def _edit_tensors(folder, edit):
    """Apply ``edit(dict)`` to every shard of ``folder`` holding tensors it touches, keeping the index in step."""
    index = folder / "model.safetensors.index.json"
    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(shard))
        before = set(tensors)
        edit(tensors)
        save_file(tensors, str(shard), metadata={"format": "pt"})
        if index.exists():
            idx = json.loads(index.read_text())
            for gone in before - set(tensors):
                del idx["weight_map"][gone]
            for new in set(tensors) - before:
                idx["weight_map"][new] = shard.name
            index.write_text(json.dumps(idx))


def _convert_fails(root, exc, match, **kw):
    with pytest.raises(exc, match=match):
        convert_pair(root / "target", root / "drafter", root / "out", tp_size=kw.pop("tp_size", 1), progress=False, **kw)
    _assert_nothing_written(root)


def test_corrupt_header_and_truncated_data(copy_forms):
    root = copy_forms("fp8")
    shard = root / "target" / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    shard.write_bytes(bytes(data[:-100]))
    _convert_fails(root, CheckpointError, r"model-00002-of-00002.safetensors: not a readable safetensors file \(header describes "
                                          r"\d+ bytes of tensor data but the file holds \d+; the file is truncated")
    data[8:12] = b"\xff\xfe{{"
    shard.write_bytes(bytes(data))
    _convert_fails(root, CheckpointError, "model-00002-of-00002.safetensors: not a readable safetensors file .header is not valid JSON")


def test_wrong_dtype(copy_forms):
    root = copy_forms("bf16")
    name = "model.layers.0.input_layernorm.weight"
    _edit_tensors(root / "target", lambda t: t.__setitem__(name, t[name].to(torch.int32)) if name in t else None)
    _convert_fails(root, CheckpointError, f"tensor '{name}' has dtype torch.int32, expected torch.bfloat16 or")


def test_fp8_missing_scale_and_scale_shape(copy_forms):
    root = copy_forms("fp8")
    name = "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv"
    _edit_tensors(root / "target", lambda t: t.pop(name, None))
    _convert_fails(root, CheckpointError, "tensor 'model.layers.1.mlp.experts.5.down_proj.weight' is float8_e4m3fn but "
                                          "'model.layers.1.mlp.experts.5.down_proj.weight_scale_inv' is missing")
    shutil.rmtree(root / "target")
    shutil.rmtree(root / "drafter")
    root = copy_forms("fp8")
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"  # 224 × 320 → 2 × 3 tiles (ragged)
    _edit_tensors(root / "target", lambda t: t.__setitem__(name, t[name][:1].clone()) if name in t else None)
    _convert_fails(root, CheckpointError, rf"tensor '{name}' has shape \[1, 3\], expected \[2, 3\] \(one scale per 128×128 tile")


def test_int4_weight_shape_disagrees_with_packed_size(copy_forms):
    root = copy_forms("int4")
    name = "model.layers.2.mlp.experts.1.gate_proj.weight_shape"
    _edit_tensors(root / "target", lambda t: t.__setitem__(name, torch.tensor([256, 384], dtype=torch.int32)) if name in t else None)
    _convert_fails(root, CheckpointError, r"tensor 'model.layers.2.mlp.experts.1.gate_proj.weight_shape' = \[256, 384\] disagrees with "
                                          r"'model.layers.2.mlp.experts.1.gate_proj.weight_packed' of shape \[256, 40\]")


def test_unknown_quant_method(copy_forms):
    root = copy_forms("fp8")
    _edit_json(root / "target" / "config.json", quantization_config={"quant_method": "awq", "bits": 4})
    _convert_fails(root, CheckpointError, r"config.json: quantization_config.quant_method = 'awq' is not supported")
    cfg = json.loads((root / "target" / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k2"


def test_k25_unknown_quant_method_names_text_config(copy_forms):
    root = copy_forms("k25")
    cfg = json.loads((root / "target" / "config.json").read_text())
    cfg["text_config"]["quantization_config"]["quant_method"] = "gptq"
    (root / "target" / "config.json").write_text(json.dumps(cfg))
    _convert_fails(root, CheckpointError, r"config.json: text_config: quantization_config.quant_method = 'gptq'")


def test_drafter_fc_width_not_three_target_hidden(copy_forms):
    root = copy_forms("bf16")
    _edit_tensors(root / "drafter", lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :640].clone()))
    _convert_fails(root, CheckpointError, r"tensor 'fc.weight' has 640 input columns, expected 3 × target hidden size = 3 × 320 = 960")


def test_aux_id_past_the_last_layer_input_convention(copy_forms):
    root = copy_forms("bf16")
    cfg = json.loads((root / "drafter" / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 4]  # 3 = after the last block is fine; 4 is not
    (root / "drafter" / "config.json").write_text(json.dumps(cfg))
    _convert_fails(root, CheckpointError, r"contains 4, out of range for a 3-layer target under the 'input' convention \(largest valid id: 3\)")


def test_d2t_outside_target_vocabulary(copy_forms):
    root = copy_forms("bf16")

    def edit(t):
        t["d2t"] = t["d2t"].clone()
        t["d2t"][-1] = 10_000
        t.pop("t2d")

    _edit_tensors(root / "drafter", edit)
    _convert_fails(root, CheckpointError, r"tensor 'd2t' maps draft id 127 to target id 10127, outside the target vocabulary \[0, 512\)")


def test_tokenizer_larger_than_the_model_vocabulary(copy_forms):
    from tokenizers import Tokenizer, models

    root = copy_forms("bf16")
    vocab = {f"t{i}": i for i in range(600)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(root / "target" / "tokenizer.json"))
    _convert_fails(root, CheckpointError, r"tokenizer.json: the tokenizer has 600 token ids but config.json's vocab_size is 512")


def test_int4_config_and_tensors_disagree(copy_forms):
    root = copy_forms("int4")
    _edit_json(root / "target" / "config.json", quantization_config={
        **json.loads((root / "target" / "config.json").read_text())["quantization_config"], "ignore": ["lm_head"]})
    _convert_fails(root, CheckpointError, r"tensor 'model.layers.0.self_attn.q_a_proj.weight_packed' is missing \(it holds "
                                          r"'model.layers.0.self_attn.q_a_proj.weight' instead\): quantization_config quantises")


def test_int4_scale_of_the_wrong_group_count(copy_forms):
    root = copy_forms("int4")
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale"  # [320, 256 / 32 = 8]
    _edit_tensors(root / "target", lambda t: t.__setitem__(name, t[name][:, :4].clone()) if name in t else None)
    _convert_fails(root, CheckpointError, rf"tensor '{name}' has shape \[320, 4\], expected \[320, 8\] \(one scale per 32 inputs\)")


@pytest.mark.parametrize("field,value,match", [
    ("num_bits", 8, r"config_groups.group_0.weights.num_bits = 8, expected 4"),
    ("group_size", 12, r"config_groups.group_0.weights.group_size = 12, expected a positive multiple of 8"),
    ("group_size", 48, r"'model.layers.1.mlp.experts.0.down_proj.weight_packed'\): group_size 48 does not divide hidden_size 320"),
])
def test_int4_unsupported_bits_or_group(copy_forms, field, value, match):
    root = copy_forms("int4")
    cfg = json.loads((root / "target" / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"][field] = value
    (root / "target" / "config.json").write_text(json.dumps(cfg))
    _convert_fails(root, CheckpointError, match)


def test_int4_nibble_order_mismatch_found_by_a_known_value_check(copy_forms, forms):
    """Words packed high nibble first: every shape is right, so only values can tell; the float original is the
    reference (a real checkpoint carries none: docs/formats.md says what is checked then)."""
    from splitspec import quant

    root = copy_forms("int4")

    def repack(t):  # the same values, column j of each word in nibble 7 − j
        for n in [n for n in t if n.endswith("weight_packed")]:
            v = quant.unpack_int4(t[n], t[n].shape[1] * 8).long()
            t[n] = quant.pack_int4(v.view(v.shape[0], -1, 8).flip(-1).reshape(v.shape))
            assert torch.equal(quant.unpack_int4(t[n], v.shape[1], quant.NIBBLE_ORDERS["high nibble first"]).long(), v)

    _edit_tensors(root / "target", repack)
    _convert_fails(root, CheckpointError, r"tensor 'model.layers.1.mlp.experts.0.gate_proj.weight_packed' rows 0-3 unpacked low "
                                          r"nibble first differ from 'model.layers.1.mlp.experts.0.gate_proj.weight' of .* by "
                                          r"\d+\.\d scale steps \(at most 0.6 expected\): it agrees with the high nibble first order",
                   int4_reference=forms / "float")


def test_int4_expert_tp_split_cutting_groups(demo_models, tmp_path):
    """The demo target's experts are 128 wide: at TP8 each rank would get 16 of down_proj's inputs, half a group."""
    from splitspec.testing.fixtures import write_int4_copy

    write_int4_copy(demo_models / "target", tmp_path / "target")
    shutil.copytree(demo_models / "drafter", tmp_path / "drafter")
    with pytest.raises(CheckpointError, match=r"expert-TP 8 gives each rank 16 of down_proj's 128 input columns, not whole "
                                              r"groups of 32; choose a smaller --tp or a larger --ep"):
        convert_pair(tmp_path / "target", tmp_path / "drafter", tmp_path / "out", tp_size=8, progress=False)
    _assert_nothing_written(tmp_path)


def test_output_that_would_destroy_an_input_or_a_file_is_refused(pair, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="would replace the input"):
        convert_pair(pair / "target", pair / "drafter", pair / "target")
    (tmp_path / "afile").write_text("keep me")
    with pytest.raises(ConfigError, match="existing file"):
        convert_pair(pair / "target", pair / "drafter", tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "keep me"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="current folder"):
        convert_pair(pair / "target", pair / "drafter", tmp_path)
    assert (pair / "target" / "config.json").exists()


def test_rope_scaling_of_the_wrong_type(pair):
    _edit_json(pair / "target" / "config.json", rope_scaling="yarn")
    with pytest.raises(CheckpointError, match="rope_scaling"):
        convert_pair(pair / "target", pair / "drafter", pair / "out")
