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


def test_write_atomic_refuses_a_fifo_and_names_the_path_not_its_temporary_file(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError, match=r"not a regular file, refused as an output: '.*/fifo'"):
        write_json({}, tmp_path / "fifo")
    assert (tmp_path / "fifo").exists() and not (tmp_path / "fifo").is_file()  # still the FIFO
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"a parent of it is a file, not a folder: '.*/file/p.json'"):
        write_json({}, tmp_path / "file" / "p.json")
    with pytest.raises(NotADirectoryError, match=r"Not a directory: '.*/file/sub/p.json'"):
        write_json({}, tmp_path / "file" / "sub" / "p.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "file"]


def test_atomic_dir_refuses_an_existing_folder_inside_an_input(tmp_path):
    from splitspec.files import atomic_dir

    (tmp_path / "ck" / "target").mkdir(parents=True)
    (tmp_path / "ck" / "target" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"output folder would replace part of the input .*/ck; choose another"):
        with atomic_dir(tmp_path / "ck" / "target", keep=(tmp_path / "ck",)):
            pytest.fail("the body ran")
    assert (tmp_path / "ck" / "target" / "config.json").read_text() == "{}"
    with atomic_dir(tmp_path / "ck" / "engines", keep=(tmp_path / "ck",)) as out:  # a new folder inside: allowed
        (out / "x").write_text("y")
    assert (tmp_path / "ck" / "engines" / "x").read_text() == "y"
