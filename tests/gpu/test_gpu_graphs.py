"""How a :class:`splitspec.engine.graphs.GraphCache` replay takes its inputs on a GPU: a key's pinned staging buffer is
copied up inside the graph (the replay sees what the host wrote there since), a shared device buffer is read in place
(another tensor given for it is copied into it first), and a host tensor other than the captured one is refused. The
engine relies on all three for the draft phase (:meth:`RankRunner.draft_padded`); its greedy exactness with them:
tests/gpu/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from splitspec.engine.graphs import GraphCache

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def _scaled(flat: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    return flat.float()[:, None] * 10 + shared


def test_staging_copied_in_the_graph_and_shared_buffers_read_in_place():
    cache = GraphCache("cuda:0")
    shared = cache.shared("x", (4, 3), torch.float32)
    assert shared is cache.shared("x", (4, 3), torch.float32), "one buffer per name"
    for step in range(3):
        flat, (field,) = cache.staging("k", ((4,),))
        field[:] = [step, step + 1, step + 2, step + 3]
        shared.fill_(step * 0.5)
        out = cache.run("k", _scaled, flat, shared)
        expect = torch.tensor(field, dtype=torch.float32)[:, None] * 10 + step * 0.5
        torch.testing.assert_close(out.cpu(), expect.expand(4, 3), msg=f"replay {step} read stale inputs")
    assert len(cache.graphs) == 1
    other = torch.full((4, 3), 7.0, device="cuda")
    flat, (field,) = cache.staging("k", ((4,),))
    out = cache.run("k", _scaled, flat, other)
    torch.testing.assert_close(out.cpu(), (torch.tensor(field, dtype=torch.float32)[:, None] * 10 + 7).expand(4, 3))
    assert torch.equal(shared.cpu(), other.cpu()), "a tensor given in a shared buffer's place is copied into it"


def test_a_host_input_other_than_the_staging_buffer_is_refused():
    cache = GraphCache("cuda:0")
    flat, (field,) = cache.staging("k", ((4,),))
    field[:] = 1
    shared = cache.shared("x", (4, 3), torch.float32)
    cache.run("k", _scaled, flat, shared)
    with pytest.raises(ValueError, match="staging buffer"):
        cache.run("k", _scaled, flat.clone(), shared)
    with pytest.raises(ValueError, match="differ from its first call"):
        cache.staging("k", ((5,),))
