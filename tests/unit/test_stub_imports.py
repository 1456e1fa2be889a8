"""The Triton models' Python stubs load no torch: each imports only what it forwards (the engine runs in a process of
its own), so a server start pays no torch import per stub and a stub holds no torch in its memory."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2] / "triton_repo"
STUBS = sorted(REPO.glob("*/1/model.py"))


def splitspec_imports(model: Path) -> list[str]:
    """The splitspec modules a stub imports at its top level."""
    tree = ast.parse(model.read_text())
    return sorted({n.module for n in tree.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("splitspec")}
                  | {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names if a.name.startswith("splitspec")})


@pytest.mark.parametrize("model", STUBS, ids=lambda p: p.parts[-3])
def test_stub_imports_no_torch(model):
    mods = splitspec_imports(model)
    assert mods, f"{model}: no splitspec import found (the stub reads nothing of this project?)"
    # and what parsing a request imports when the first one comes
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods) + "import numpy as np\n"
            "from splitspec.serving.requests import parse_request\n"
            "parse_request({'input_ids': np.array([1, 2]), 'max_tokens': np.array([4])}, 8)\n"
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"{model.parts[-3]} loads {out.stdout.strip()} through {mods}"
