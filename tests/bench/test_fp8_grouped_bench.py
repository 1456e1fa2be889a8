"""bench/lab/fp8_grouped_bench.py: its block-configuration sweep keeps, per kernel, the candidate fastest summed over
the token counts (gate/up first, then down with gate/up's winner), and argument errors come before any GPU check."""

from __future__ import annotations

import pytest

from lab import fp8_grouped_bench as fgb


def test_sweep_keeps_each_kernels_fastest_with_the_other_at_its_best(monkeypatch, capsys):
    fast_gate_up, fast_down = fgb.SWEEP[4], fgb.SWEEP[6]
    calls = []

    def cost(configs, T):  # ms: each kernel's own term, the down term only at gate/up's winner counted as given
        gate_up, down = configs
        return T * ((1.0 if gate_up == fast_gate_up else 2.0 + fgb.SWEEP.index(gate_up)) +
                    (0.5 if down == fast_down else 1.5 + fgb.SWEEP.index(down)))

    monkeypatch.setattr(fgb, "timed_graph", lambda fn, warm, reps: fn())

    def call(T, configs):
        calls.append((T, configs))
        return lambda: cost(configs, T)

    gate_up, down, times = fgb.sweep(call, [64, 512], 3)
    assert (gate_up, down) == (fast_gate_up, fast_down)
    assert len(calls) == 2 * 2 * len(fgb.SWEEP)
    assert all(c[1] == fgb.fp8_grouped.DOWN for _, c in calls[:2 * len(fgb.SWEEP)])  # gate/up swept with down as configured
    assert all(c[0] == fast_gate_up for _, c in calls[2 * len(fgb.SWEEP):])  # down swept with gate/up's winner
    assert times["down"][str(fast_down)] == pytest.approx(cost((fast_gate_up, fast_down), 64) + cost((fast_gate_up, fast_down), 512))
    assert f"GATE_UP = {fast_gate_up}\nDOWN = {fast_down}" in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [(["--tokens", "16"], "--tokens 16: each above 16"),
                                        (["--sweep-tokens", "64,x"], "--sweep-tokens '64,x': expected a comma list"),
                                        (["--tp", "3"], "--tp 3: expected a split"), (["--reps", "0"], "--reps 0")])
def test_bad_arguments_are_named_before_the_gpu_check(args, says, capsys):
    with pytest.raises(SystemExit) as e:
        fgb.main(args)
    assert e.value.code == 2 and says in capsys.readouterr().err
