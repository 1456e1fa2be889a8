"""Bad checkpoints and bad options get a clear error naming the file, tensor or field, and leave no output."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from splitspec.build import build_engines
from splitspec.cli import main as cli_main
from splitspec.convert import convert_pair
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


def test_cli_prints_one_line_error(pair, capsys):
    rc = cli_main(["convert", "--target", str(pair / "target"), "--drafter", str(pair / "drafter"), "--out", str(pair / "out"), "--tp", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: " in err and "Traceback" not in err
