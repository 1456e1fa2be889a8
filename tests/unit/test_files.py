"""files: an output folder is created, or refused in one line naming the option; a file is written whole or not at all."""

from __future__ import annotations

import pytest

from splitspec.errors import ConfigError
from splitspec.files import make_dir, read_json, write_json


def test_make_dir_creates_and_refuses_a_file(tmp_path):
    assert make_dir(tmp_path / "a" / "b", "--out").is_dir()
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="--out .*/f: an existing file"):
        make_dir(tmp_path / "f", "--out")
    with pytest.raises(ConfigError, match="cannot be created"):
        make_dir(tmp_path / "f" / "sub", "--out")


def test_write_atomic_over_a_folder_names_the_folder_and_leaves_nothing(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(IsADirectoryError, match=r"a folder, expected a file path: '.*/out'"):
        write_json({"a": 1}, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and not any((tmp_path / "out").iterdir())
    write_json({"a": 1}, tmp_path / "f.json")
    assert read_json(tmp_path / "f.json") == {"a": 1}
