"""AuxStates: a verify's batch kept whole reads like per-sequence entries, is handed back as it is only for the same
sequences in the same order untouched since, and a sequence left out of the next batch keeps its rows."""

from __future__ import annotations

import pytest
import torch

from splitspec.engine.aux_states import AuxStates


def test_kept_batch_reads_per_sequence_and_is_reused_only_unchanged():
    aux = AuxStates()
    aux[1], aux[9] = torch.ones(2, 3), torch.full((3, 3), 9.0)
    first = torch.arange(24.0).view(8, 3)  # 3 sequences of 2 rows in a bucket of 4
    aux.keep_batch([1, 2, 3], first, 2)
    assert torch.equal(aux[2], first[2:4]) and aux.rows(2) == 2 and aux.rows(9) == 3 and 9 in aux and 4 not in aux
    assert aux.batch_for([1, 2, 3], 8, "cpu") is first
    reordered = aux.batch_for([2, 1, 3], 8, "cpu")
    assert torch.equal(reordered, torch.cat((first[2:4], first[:2], first[4:6], torch.zeros(2, 3))))
    second = torch.zeros(4, 3)
    aux.keep_batch([1, 5], second, 2)
    assert torch.equal(aux[3], first[4:6]) and torch.equal(aux[1], second[:2])  # 3: left out, its rows kept
    aux[5] = torch.ones(1, 3)
    assert aux.batch_for([1, 5], 4, "cpu") is not second and aux.rows(5) == 1
    assert torch.equal(aux.pop(1), second[:2]) and 1 not in aux and aux.pop(1, None) is None
    with pytest.raises(KeyError):
        aux.rows(1)
