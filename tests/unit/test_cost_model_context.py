"""KimiScale's context term: each sequence's cached MLA latent rows (512 latent + 64 rope values, bf16: 1152 bytes a
key), read per layer by every TP rank once per block of 16 head × token query rows (the latent kernel's programs), on
top of the weight bytes; checked against hand-computed bytes and times."""

from __future__ import annotations

import dataclasses
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

from splitspec.build.synthetic import KIMI_DRAFTER_PROFILE
from splitspec.measure.cost_model import KimiScale, best_k, fit_depth

ROW = (512 + 64) * 2  # bytes of one cached key's latent row, bf16
# TP8 shard bytes by hand (H 7168): attention 7168·(1536 + 576)·2 + (1536·64·192 + 64·128·512·2 + 64·128·7168)·2/8
ATTN = 30_277_632 + 21_495_808
DENSE = ATTN + 99_090_432  # + the dense MLP 3·7168·18432·2/8
MOE_T1 = ATTN + 8 * 5_505_024 * 2 + 5_505_024 * 2 + 384 * 7168 * 4  # 8 experts' slices + shared + router, one token
HEAD = 163840 * 7168 * 2 // 8
BW = 4200 * 0.7 * 1e6  # bytes per ms at the default efficiency


def test_layer_bytes_add_each_sequences_latent_rows():
    assert (DENSE, MOE_T1) == (150_863_872, 161_873_920)
    m = KimiScale(context_tokens=4096)
    # batch 16, k 3: 64 verified tokens; the dense layer's weights do not depend on them, the rows on B × context,
    # read twice: a TP8 rank's 8 heads × 4 tokens of a sequence are two blocks of 16 query rows
    assert m.layer_bytes(64, moe=False, sequences=16) == DENSE + 2 * 16 * 4096 * 1152 == 301_858_816
    assert m.layer_bytes(16, moe=False, sequences=16) == DENSE + 16 * 4096 * 1152  # k 0: 8 rows, one block
    assert m.layer_bytes(1, moe=True, sequences=1) == pytest.approx(MOE_T1 + 4096 * ROW)
    dense_tp4 = 30_277_632 + 2 * 21_495_808 + 2 * 99_090_432  # the sharded weights twice the TP8 slices
    # the cache is replicated on every rank: its rows do not shrink with TP, the weights do; 16 heads × 4 tokens: 4 blocks
    assert KimiScale(context_tokens=4096, tp=4).layer_bytes(64, moe=False, sequences=16) == dense_tp4 + 4 * 16 * 4096 * ROW
    assert KimiScale(context_tokens=4096, tp=1).layer_bytes(6, moe=False, sequences=1) > 24 * 4096 * ROW  # 64 × 6 / 16
    assert KimiScale().layer_bytes(64, moe=False, sequences=16) == DENSE


def test_context_zero_is_the_weights_only_model():
    """The default (context 0) gives the figures of the weights-only formula, here from its constants by hand."""
    m = KimiScale()
    assert m.context_tokens == 0
    ar1 = 13 + 7168 * 2 / 150e3  # µs, one all-reduce of one token's row
    verify = (DENSE + 60 * MOE_T1) / BW + 61 * (10 + 2 * ar1) / 1e3 + HEAD / (4200 * 0.87 * 1e6) + ar1 / 1e3
    assert m.verify_ms(1, 0) == pytest.approx(verify, rel=1e-12)
    assert m.bandwidth_bound_ms(1, 0) == pytest.approx((DENSE + 60 * MOE_T1 + HEAD) / 4.2e9, rel=1e-12)


def test_verify_and_bound_grow_by_the_rows_read():
    base, long = KimiScale(), KimiScale(context_tokens=4096)
    rows = 61 * 16 * 4096 * ROW  # every layer, 16 sequences
    assert long.bandwidth_bound_ms(16, 3) - base.bandwidth_bound_ms(16, 3) == pytest.approx(2 * rows / 4.2e9)
    assert long.verify_ms(16, 3) > KimiScale(context_tokens=1024).verify_ms(16, 3) > base.verify_ms(16, 3)
    # k 3 at TP8 reads them twice (two blocks of 16 query rows), k 0 and 1 once
    assert long.verify_ms(16, 3) - base.verify_ms(16, 3) == pytest.approx(2 * rows / BW)
    assert long.verify_ms(16, 0) - base.verify_ms(16, 0) == pytest.approx(rows / BW)
    assert long.verify_ms(16, 1) - base.verify_ms(16, 1) == pytest.approx(rows / BW)
    assert long.cycle_ms(16, 3, "tp1") - base.cycle_ms(16, 3, "tp1") == pytest.approx(2 * rows / BW)


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf")])
def test_a_context_that_is_not_a_finite_non_negative_count_is_refused(bad):
    with pytest.raises(ValueError, match="context_tokens") as e:
        KimiScale(context_tokens=bad)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="context_tokens"):
        dataclasses.replace(KimiScale(), context_tokens=bad)


def test_depth_fit_mode_refuses_a_context():
    """The fitted lines hold the short windows they were measured at; no context is added to them."""
    rows = [{"layers": L, "batch": 1, "k": 0, "draft_tp": None, "cycle_ms": 2.0 + 0.2 * L, "draft_ms": 0.0,
             "verify_ms": 1.5 + 0.2 * L} for L in (2, 8)]
    fit = fit_depth(rows)
    with pytest.raises(ValueError, match="context_tokens 4096.*depth_fit") as e:
        KimiScale.from_depth_fit(fit, context_tokens=4096)
    assert "\n" not in str(e.value)
    assert KimiScale.from_depth_fit(fit).verify_ms(1, 0) > 0  # context 0 (the default) is taken


def test_a_long_context_moves_the_best_k_down():
    """A verify of more tokens per sequence reads the rows in more blocks (TP8: 2 blocks from k 2, 3 from k 4), so at a
    long context fewer drafts pay: with the drafter on one GPU batch 4's best k goes from 2 to 1 and batch 16's from 5
    to 3 at 32768 keys per sequence; at batch 1 the rows are a small share and k stays 3."""
    for B, want in ((1, [3, 3]), (4, [2, 1]), (16, [5, 3])):
        assert [best_k(KimiScale(context_tokens=c), B, "tp1", KIMI_DRAFTER_PROFILE)[0] for c in (0, 32768)] == want, B


@pytest.mark.parametrize("good, want", [(np.int64(4096), 4096.0), (np.float32(512.5), 512.5), (Fraction(1, 2), 0.5),
                                        (10 ** 9, 1e9)])
def test_a_numpy_or_rational_count_is_taken_as_a_float(good, want):
    m = KimiScale(context_tokens=good)
    assert type(m.context_tokens) is float and m.context_tokens == want


@pytest.mark.parametrize("bad", [10 ** 400, 1e308, 1e9 + 1, "4096", Decimal(3), np.float64("nan"), True, Fraction(-1, 2)])
def test_a_huge_or_non_real_context_is_refused_in_one_line(bad):
    """A context past 1e9 keys would take every figure to inf (and best k to 0 tokens/s); 10**400 is no float."""
    with pytest.raises(ValueError, match=r"context_tokens: .*≤ 1e\+09") as e:
        KimiScale(context_tokens=bad)
    assert "\n" not in str(e.value)


def test_a_huge_integer_context_is_shown_short():
    with pytest.raises(ValueError, match=r"context_tokens: a number past 1e\+308, expected") as e:
        KimiScale(context_tokens=10 ** 5000)  # its repr would pass Python's 4300-digit limit
    assert len(str(e.value)) < 200


def test_the_models_block_of_query_rows_is_the_kernels():
    """The cost model counts the rows once per block of the latent kernel's query rows: the same 16 as the kernel's."""
    from splitspec.measure import cost_model
    from splitspec.models import paged_attention

    assert cost_model.LATENT_BLOCK_M == paged_attention.LATENT_BLOCK_M
