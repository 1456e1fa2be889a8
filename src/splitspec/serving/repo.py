"""Rendering the Triton model repository for a pair of built engines.

The repository follows the TensorRT-LLM backend's layout: ``preprocessing`` (tokenise) →
``spec_decode`` (decoupled; target + drafter engines, draft/verify loop) → ``postprocessing``
(detokenise), chained by the ``ensemble`` model. Each model's ``config.pbtxt`` is rendered
from the ``config.pbtxt.in`` template kept next to its code in the project's ``triton_repo/``
(``string.Template`` placeholders such as ``${engines_dir}``). Rendering into another folder
also copies the models' code there. Every file is written to a temporary name and renamed
into place.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from string import Template

from splitspec.errors import ConfigError
from splitspec.files import write_atomic

#: Models of the repository, in pipeline order (the ensemble last).
MODELS = ("preprocessing", "spec_decode", "postprocessing", "ensemble")
TEMPLATE_NAME = "config.pbtxt.in"
#: Largest max_tokens a request may ask for.
MAX_TOKENS_LIMIT = 4096
#: Seconds between two ``is_cancelled()`` checks of one stream, in ``spec_decode`` (requests sent to it directly)
#: and ``postprocessing`` (ensemble streams). Each check is an IPC round trip between the Python backend's stub
#: and tritonserver (0.1–0.25 ms): postprocessing never checks a stream's first response, spec_decode checks
#: after sending a response, not before it.
CANCEL_POLL_S = 0.05


def template_repo() -> Path:
    """The project's ``triton_repo/`` folder holding the templates and model code.

    Raises:
        ConfigError: the folder is not there (splitspec installed without its source tree).
    """
    root = Path(__file__).resolve().parents[3] / "triton_repo"
    if not (root / "ensemble" / TEMPLATE_NAME).is_file():
        raise ConfigError(f"{root}: model repository templates not found (use an editable install of splitspec)")
    return root


def _parse_ids(value: str, what: str) -> list[int]:
    """Parse ``"0,1,2"`` (or ``""``) into GPU ids; ConfigError naming ``what`` otherwise."""
    value = (value or "").strip()
    if not value:
        return []
    ids = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ConfigError(f"{what} = {value!r}: expected comma-separated non-negative GPU ids, e.g. '0,1'")
        ids.append(int(part))
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{what} = {value!r}: a GPU id appears twice")
    return ids


def _engine_json(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: engine description missing (build the engines first: 'make engines')")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _find_int(d: dict, *keys: str) -> int | None:
    """First integer found under ``keys`` at the top level or in a nested ``mapping``/``limits`` dict."""
    for where in (d, d.get("mapping") or {}, d.get("limits") or {}, d.get("build") or {}):
        if not isinstance(where, dict):
            continue
        for k in keys:
            v = where.get(k)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def _optional_positive(value: int | None, what: str) -> str:
    """'' for None, else the integer as text; ConfigError naming ``what`` unless it is an int ≥ 1."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} = {value!r}: expected an integer >= 1 (or nothing for the engine's default)")
    return str(value)


def render_repo(engines_dir: Path, out_dir: Path, *, num_draft_tokens: int | None = None, target_device_ids: str = "",
                draft_device_id: str = "", draft_tp: int | None = None, max_batch_size: int | None = None,
                kv_tokens: int | None = None, synthetic_acceptance: list[float] | None = None) -> Path:
    """Write the model repository for the engines in ``engines_dir`` to ``out_dir``.

    Args:
        engines_dir: folder holding ``target/`` and ``drafter/`` (each with ``engine.json``;
            the tokenizer files in ``target/``).
        out_dir: repository folder; the project's ``triton_repo/`` renders in place, any other
            folder also receives a copy of the models' code.
        num_draft_tokens: default draft tokens per cycle (k ≥ 0; 0: no speculation); None: the k per batch bucket of
            ``engines_dir/tuning.json`` (``splitspec tune``) when every bucket was tuned for the placement
            served (the parameter is then left empty and the engine reads the file), else 4.
        target_device_ids: GPU ids of the target ranks, comma-separated; empty: CPU.
        draft_device_id: GPU id of the TP1 drafter; empty: target rank 0's device.
        draft_tp: drafter tensor-parallel size (1, or the target's TP size); None: tuning.json's placement per
            batch bucket (left empty when the buckets' placements differ: the engine loads both), else 1.
        max_batch_size: sequences ``spec_decode`` decodes together (continuous batching);
            None: the engine's ``max_batch_size``.
        kv_tokens: KV-cache budget in tokens shared by all sequences; None: the engine's
            ``max_batch_size`` × ``max_seq_len``.
        synthetic_acceptance: BENCHMARK ONLY — per-position probabilities with which a draft token
            is accepted regardless of its value; served outputs are then NOT the target's (the
            engine labels them synthetic and the model logs a warning). None: real verification.
    Returns:
        ``out_dir`` resolved.
    Raises:
        ConfigError: an engine or tokenizer file is missing, ``out_dir`` cannot be written, or a
            parameter is invalid (the message names it).
    """
    engines_dir = Path(engines_dir).resolve()
    out_dir = Path(out_dir).resolve()
    target = _engine_json(engines_dir / "target" / "engine.json")
    drafter = _engine_json(engines_dir / "drafter" / "engine.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if not (engines_dir / "target" / f).is_file():
            raise ConfigError(f"{engines_dir / 'target' / f}: tokenizer file missing from the target engine")

    from splitspec.runtime.scheduler import read_tuning

    tuning = read_tuning(engines_dir)  # refused here, naming the file, if it does not fit these engines
    if num_draft_tokens is not None and (isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int)
                                         or num_draft_tokens < 0):
        raise ConfigError(f"num_draft_tokens (-k) = {num_draft_tokens!r}: expected an integer >= 0 (0: no speculation)")
    max_draft = _find_int(drafter, "max_draft_len") or _find_int(target, "max_draft_len")
    if max_draft is not None and num_draft_tokens is not None and num_draft_tokens > max_draft:
        raise ConfigError(f"num_draft_tokens (-k) = {num_draft_tokens} exceeds the engines' max_draft_len "
                          f"{max_draft} ({engines_dir}); rebuild with a larger --max-draft-len")
    tgt_ids = _parse_ids(target_device_ids, "target_device_ids")
    drf_ids = _parse_ids(draft_device_id, "draft_device_id")
    if len(drf_ids) > 1:
        raise ConfigError(f"draft_device_id = {draft_device_id!r}: expected one GPU id (or empty)")
    if drf_ids and not tgt_ids:
        raise ConfigError(f"draft_device_id = {draft_device_id!r} needs target_device_ids too (empty means CPU)")
    draft_tp_given = draft_tp is not None
    tuned = set(tuning["draft_tp_by_batch"].values()) if tuning else {1}
    per_bucket = draft_tp is None and len(tuned) > 1  # "": the engine follows tuning.json bucket by bucket
    if draft_tp is None and not per_bucket:
        (draft_tp,) = tuned
    # k: as given; else "" (the engine takes tuning.json's k per batch bucket) where tuning.json was made
    # for the placement(s) served; else 4
    k_value = str(num_draft_tokens) if num_draft_tokens is not None else (
        "" if tuning and (per_bucket or tuned == {draft_tp}) else "4")
    if not per_bucket and (isinstance(draft_tp, bool) or not isinstance(draft_tp, int) or draft_tp < 1):
        raise ConfigError(f"draft_tp = {draft_tp!r}: expected an integer >= 1")
    tp = _find_int(target, "tp_size")
    if tp is not None:
        if tgt_ids and len(tgt_ids) != tp:
            raise ConfigError(f"target_device_ids = {target_device_ids!r} lists {len(tgt_ids)} GPUs, but the "
                              f"target engine has tp_size {tp} ({engines_dir / 'target' / 'engine.json'})")
        if not per_bucket and draft_tp not in (1, tp):
            raise ConfigError(f"draft_tp = {draft_tp}: expected 1 (own device) or the target's tp_size {tp}")
    if not per_bucket and draft_tp > 1 and drf_ids:
        where = "" if draft_tp_given else f" (draft_tp {draft_tp} from {engines_dir / 'tuning.json'})"
        raise ConfigError(f"draft_device_id applies to a TP1 drafter only; with draft_tp > 1{where} the drafter "
                          "runs on target_device_ids")

    synthetic_value = ""
    if synthetic_acceptance is not None:
        probs = list(synthetic_acceptance)
        if not probs or any(isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0
                            for p in probs):
            raise ConfigError(f"synthetic_acceptance = {synthetic_acceptance!r}: expected a non-empty list of "
                              "probabilities in [0, 1]")
        synthetic_value = ",".join(repr(float(p)) for p in probs)
    batch_value = _optional_positive(max_batch_size, "max_batch_size")
    kv_value = _optional_positive(kv_tokens, "kv_tokens")

    values = {
        "engines_dir": str(engines_dir),
        "tokenizer_dir": str(engines_dir / "target"),
        "num_draft_tokens": k_value,
        "target_device_ids": ",".join(map(str, tgt_ids)),
        "draft_device_id": ",".join(map(str, drf_ids)),
        "draft_tp": "" if per_bucket else str(draft_tp),
        "max_tokens_limit": str(MAX_TOKENS_LIMIT),
        "max_batch_size": batch_value,
        "kv_tokens": kv_value,
        "synthetic_acceptance": synthetic_value,
    }
    for k, v in values.items():
        if '"' in v or "\\" in v or "\n" in v:
            raise ConfigError(f"{k} = {v!r}: quotes, backslashes and newlines cannot go into config.pbtxt")

    src = template_repo()
    in_place = src == out_dir
    texts = {}
    for model in MODELS:  # everything rendered and every destination checked before anything is written
        tpl_path = src / model / TEMPLATE_NAME
        try:
            texts[model] = Template(tpl_path.read_text(encoding="utf-8")).substitute(values)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"{tpl_path}: bad placeholder {e}") from None
        for path, folder in ((out_dir, True), (out_dir / model, True), (out_dir / model / "1", True),
                             (out_dir / model / "config.pbtxt", False)):
            if path.exists() and path.is_dir() != folder:
                raise ConfigError(f"out_dir (--out) {out_dir}: cannot write the repository there ({path} is "
                                  f"{'a file' if folder else 'a folder'}; expected {'a folder' if folder else 'a file'})")
    for model, text in texts.items():
        try:
            if not in_place:
                _copy_model_code(src / model, out_dir / model)
            (out_dir / model / "1").mkdir(parents=True, exist_ok=True)
            write_atomic(out_dir / model / "config.pbtxt", text.encode("utf-8"))
        except OSError as e:  # not a folder, no permission, a read-only file system, ...
            raise ConfigError(f"out_dir (--out) {out_dir}: cannot write the repository there "
                              f"({e.strerror or e}: {e.filename or ''})") from None
    return out_dir


def _copy_model_code(src: Path, dst: Path) -> None:
    """Copy a model folder's files (code, not templates or caches) into ``dst``, each atomically."""
    for f in src.rglob("*"):
        if not f.is_file() or f.name == TEMPLATE_NAME or f.name == "config.pbtxt" or "__pycache__" in f.parts:
            continue
        write_atomic(dst / f.relative_to(src), f.read_bytes(), mode=0o644)


def repo_setting(repo: Path, model: str, key: str) -> str | None:
    """A ``parameters`` value from ``repo/<model>/config.pbtxt`` (None when absent)."""
    try:
        text = (Path(repo) / model / "config.pbtxt").read_text(encoding="utf-8")
    except OSError:
        return None
    m = re.search(r'key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
    return m.group(1) if m else None
