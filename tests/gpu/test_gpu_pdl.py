"""Programmatic dependent launch (``ServeConfig.pdl``) reaches the kernels: with ``pdl`` the Triton kernels that
:func:`splitspec.models.layers.compile_parts` generates wait for their predecessor's writes inside the GPU
(``gdc_wait``) and are launched with the PDL attribute; without it they are not. Needs a Hopper-or-later GPU
(greedy exactness with it on: tests/gpu/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def _norm_then_scale(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g).relu() + 1


@pytest.mark.parametrize("torch_default", [False, True])
@pytest.mark.parametrize("pdl", [False, True])
def test_compiled_parts_launch_with_pdl_when_asked(pdl, torch_default, monkeypatch):
    """The switch decides, whatever torch's own default (``TORCHINDUCTOR_ENABLE_PDL``) says."""
    import torch._inductor.config
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(torch._inductor.config.triton, "enable_pdl", torch_default)

    from splitspec.models.layers import compile_parts

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or later")
    torch._dynamo.reset()
    (fn,) = compile_parts(_norm_then_scale, pdl=pdl)
    x, g = torch.randn(4, 512, device="cuda"), torch.rand(512, device="cuda")
    out, code = run_and_get_code(fn, x, g)
    torch.testing.assert_close(out, _norm_then_scale(x, g))
    text = "\n".join(code)
    assert ("gdc_wait" in text) == pdl, "generated code and the pdl switch disagree"
    assert ("'launch_pdl': True" in text) == pdl
