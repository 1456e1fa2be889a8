"""files.make_dir: an output folder is created, or refused in one line naming the option."""

from __future__ import annotations

import pytest

from splitspec.errors import ConfigError
from splitspec.files import make_dir


def test_make_dir_creates_and_refuses_a_file(tmp_path):
    assert make_dir(tmp_path / "a" / "b", "--out").is_dir()
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="--out .*/f: an existing file"):
        make_dir(tmp_path / "f", "--out")
    with pytest.raises(ConfigError, match="cannot be created"):
        make_dir(tmp_path / "f" / "sub", "--out")
