"""The cycle protocol between the leader and the ranks of the target's group.

Each cycle the leader broadcasts one :class:`CyclePlan` on a gloo control group; every rank executes it
(:meth:`splitspec.engine.rank.RankRunner.execute`) and rank 0 hands the leader a :class:`CycleOutput`. Only
the leader decides which tokens are accepted; the decision reaches the other ranks as the next plan
(accepted counts and tokens), so ranks never diverge on near-tied logits.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitspec.errors import SplitspecError

if TYPE_CHECKING:  # the Triton stubs import this module: no torch there
    import torch

# Workers wait for the next cycle plan on a control group of their own: an idle server may wait for
# requests indefinitely (a leader that dies closes the connection, which ends the wait at once).
IDLE_TIMEOUT = datetime.timedelta(days=365)


class EngineError(SplitspecError):
    """The engine cannot serve: a worker process died or the group broke."""


@dataclass(frozen=True)
class SampledDraw:
    """One sampled sequence's filter and random numbers for one verify: ``temperature``, ``top_p``, ``top_k`` (as
    :class:`splitspec.runtime.types.SamplingParams`), ``u`` the k uniforms in [0, 1) of the acceptance tests (float32
    values), ``v`` the uniform in [0, 1) of the token drawn after them (float64); drawn by
    :func:`splitspec.runtime.sampling.draw_cycle`, decided by :func:`splitspec.engine.acceptance.sampled_decisions`."""

    temperature: float
    top_p: float
    top_k: int
    u: tuple[float, ...]
    v: float

    @property
    def filter(self) -> tuple[float, float, int]:
        return self.temperature, self.top_p, self.top_k


@dataclass
class SeqWork:
    """One sequence's share of a cycle.

    kind 'prefill': ``tokens`` at positions start.. (a chunk of the prompt); ``final`` = last chunk.
    kind 'decode': verify ``tokens`` = [last known token] (+ this cycle's drafts) at positions start..;
    the drafter first extends rows extend_start.. with ``extend_tokens``, then takes k − 1 more steps.
    ``keep_aux``: rows of the previous verify's aux states still valid (accepted + 1); None keeps all.
    ``accept``: BENCHMARK ONLY — the drafts this cycle accepts whatever they are (synthetic acceptance), drawn by the
    leader before the cycle; None: the leader decides from the verify.
    ``sampled``: a sampled request's filter and this cycle's random numbers, drawn by the leader before the cycle
    (None: greedy, or synthetic).
    """

    sid: int
    blocks: list[int]
    kind: str
    start: int
    tokens: list[int]
    final: bool = True
    k: int = 0
    extend_start: int = 0
    extend_tokens: list[int] = field(default_factory=list)
    keep_aux: int | None = None
    accept: int | None = None
    sampled: SampledDraw | None = None


@dataclass
class CyclePlan:
    """Everything every rank needs for one cycle; ``drafts`` is filled by a TP1 drafter before sending.
    ``draft_tp``: the placement that drafts (None: the one drafting so far); ``placement_switch``: this
    message only makes ``draft_tp`` the drafting placement (:meth:`RankRunner.switch_placement`). ``ahead``: the
    leader expects the next cycle to decode these sequences again (each acceptance decidable on the device): a
    TP1 drafter may launch that cycle's draft behind this cycle's verify (:mod:`splitspec.engine.draft_ahead`)."""

    work: list[SeqWork]
    finished: list[int] = field(default_factory=list)
    drafts: dict[int, list[int]] | None = None
    shutdown: bool = False
    padded_k: int | None = None  # set by the leader: a steady decode cycle run in the static-shape form
    draft_tp: int | None = None
    placement_switch: bool = False
    ahead: bool = False


@dataclass
class CycleOutput:
    """What the leader gets back: logits [R, V] (decode works: k+1 rows each; final prefill: 1 row),
    the drafts used, and times in ms."""

    logits: torch.Tensor
    drafts: dict[int, list[int]]
    draft_ms: float
    verify_ms: float
    # argmax of every logits row, −1 where its largest logit is NaN or inf (acceptance.greedy_ids), fetched with the
    # drafts in one copy
    greedy: list[int] | None = None
    # the sampled works' decisions made on the device (a steady cycle): sid → [accepted, token, drawable]
    # (:func:`splitspec.engine.acceptance.sampled_decisions`), copied with the argmax
    sampled: dict[int, list[int]] | None = None
