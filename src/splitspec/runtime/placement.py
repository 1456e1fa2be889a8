"""Draft placement and k by batch bucket: ``tuning.json`` (written by ``splitspec tune``), what an engine load
takes from it, and the rule that decides when the drafting placement changes.

A deployment may load both placements (draft_tp 1, the split one, and draft_tp N, sharded over the target's group)
and draft each cycle with the one tuned for its batch bucket; :func:`next_placement` holds a change back until it
has been wanted for :data:`SWITCH_AFTER_CYCLES` drafting cycles in a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from splitspec.engine.engine_files import read_engine_meta
from splitspec.errors import ConfigError
from splitspec.files import read_json
from splitspec.settings import ServeConfig

#: Consecutive drafting cycles that must want the other placement before it drafts: a switch moves every drafting
#: sequence's drafter K/V and costs more than one cycle's gain from the better placement (figures: docs/lab/).
SWITCH_AFTER_CYCLES = 3


def by_bucket(table: dict[int, int], batch: int) -> int:
    """``table``'s value for the smallest bucket ≥ ``batch``, or the largest bucket's."""
    fitting = [b for b in sorted(table) if b >= batch]
    return table[fitting[0] if fitting else max(table)]


def read_tuning(engines_dir: Path) -> dict | None:
    """``engines_dir/tuning.json`` written by ``splitspec tune``, or None if there is none.

    Fields: ``k_by_batch`` {"batch": k} and either ``draft_tp_by_batch`` {"batch": draft_tp} (the same
    buckets) or ``draft_tp`` (one placement for every bucket); the result always has
    ``draft_tp_by_batch``. Raises ConfigError naming the file when a field is missing or of the wrong
    type, a k exceeds the engines' max_draft_len, or a draft_tp is neither 1 nor the target's tp_size
    (``target/engine.json``)."""
    path = Path(engines_dir) / "tuning.json"
    if not path.exists() and not path.is_symlink():  # a dangling link is refused by read_json, not taken for none
        return None
    t = read_json(path)
    if not isinstance(t, dict) or "k_by_batch" not in t or ("draft_tp" in t) == ("draft_tp_by_batch" in t):
        raise ConfigError(f"{path}: expected fields 'k_by_batch' and one of 'draft_tp_by_batch' or 'draft_tp'")
    ok = lambda v, lo: isinstance(v, int) and not isinstance(v, bool) and v >= lo  # noqa: E731
    kb = t["k_by_batch"]
    canonical = lambda b: (isinstance(b, str) and b.isascii() and b.isdigit() and len(b) <= 9  # noqa: E731
                           and b == str(int(b)) and int(b) >= 1)
    if not isinstance(kb, dict) or not kb or not all(canonical(b) and ok(k, 0) for b, k in kb.items()):
        raise ConfigError(f"{path}: k_by_batch = {repr(kb)[:200]}, expected {{\"batch ≥ 1\" (decimal, no leading zeros): k ≥ 0, ...}}")
    if "draft_tp_by_batch" in t:
        db = t["draft_tp_by_batch"]
        if not isinstance(db, dict) or set(db) != set(kb) or not all(ok(d, 1) for d in db.values()):
            raise ConfigError(f"{path}: draft_tp_by_batch = {repr(db)[:200]}, expected a positive draft_tp for each bucket of k_by_batch {sorted(kb)}")
    elif not ok(t["draft_tp"], 1):
        raise ConfigError(f"{path}: draft_tp = {t['draft_tp']!r}, expected a positive integer")
    else:
        t["draft_tp_by_batch"] = dict.fromkeys(kb, t["draft_tp"])
    target = Path(engines_dir) / "target"
    if (target / "engine.json").exists():
        meta = read_engine_meta(target, "target")
        tp, max_k = int(meta["mapping"]["tp_size"]), int(meta["limits"]["max_draft_len"])
        bad = {b: d for b, d in t["draft_tp_by_batch"].items() if d not in (1, tp)}
        if bad:
            field = "draft_tp_by_batch" if "draft_tp" not in t else "draft_tp"
            raise ConfigError(f"{path}: {field} {bad if field == 'draft_tp_by_batch' else t['draft_tp']}: expected 1 or the target's tp_size {tp}")
        if max(kb.values()) > max_k:
            raise ConfigError(f"{path}: k_by_batch = {kb!r} exceeds the engines' max_draft_len {max_k}")
    return t


@dataclass(frozen=True)
class TunedChoice:
    """What an engine load takes from ``tuning.json``: the placements to load (the first drafts first), and k and
    draft_tp by batch bucket (``{}``: not followed)."""

    placements: tuple[int, ...]
    k_by_batch: dict[int, int] = field(default_factory=dict)
    draft_tp_by_batch: dict[int, int] = field(default_factory=dict)


def tuned_choice(cfg: ServeConfig) -> TunedChoice:
    """The placements and per-bucket choices for the deployment ``cfg``.

    ``cfg.draft_tp`` / ``cfg.num_draft_tokens`` left None take the choice ``splitspec tune`` wrote to
    ``engines_dir/tuning.json`` (placement and k per batch-size bucket: where the buckets' placements
    differ, both are loaded and each cycle drafts with its bucket's), else draft_tp 1 and k 4. With
    ``draft_tp`` given, k follows tuning.json only where every bucket was tuned for that placement."""
    draft_tp, num_draft_tokens = cfg.draft_tp, cfg.num_draft_tokens
    tuning = read_tuning(cfg.engines_dir) if draft_tp is None or num_draft_tokens is None else None  # not read when unused
    tuned = {int(b): int(d) for b, d in tuning["draft_tp_by_batch"].items()} if tuning else {}
    # with both, the smallest bucket's placement drafts first
    placements = (draft_tp,) if draft_tp is not None else tuple(sorted(set(tuned.values()), key=lambda d: (d != tuned[min(tuned)], d))) or (1,)
    k_by_batch = {}
    if num_draft_tokens is None and tuning and set(tuned.values()) <= set(placements):
        k_by_batch = {int(b): int(k) for b, k in tuning["k_by_batch"].items()}
    return TunedChoice(placements, k_by_batch, tuned if len(placements) > 1 else {})


def next_placement(now: int, want: int, wanting_other: int, switch_after: int = SWITCH_AFTER_CYCLES) -> tuple[int, int]:
    """The switch rule: the placement a drafting cycle drafts with, and the updated count of consecutive drafting
    cycles that wanted the other one. ``now`` drafts until ``switch_after`` consecutive cycles have wanted
    ``want`` ≠ ``now``, so that a batch hovering at a bucket's edge does not pay a switch every cycle."""
    wanting_other = wanting_other + 1 if want != now else 0
    if wanting_other < max(1, switch_after):
        return now, wanting_other
    return want, 0
