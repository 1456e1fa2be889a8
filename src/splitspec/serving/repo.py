"""Rendering the Triton model repository for a pair of built engines.

The repository follows the TensorRT-LLM backend's layout: ``preprocessing`` (tokenise) →
``spec_decode`` (decoupled; target + drafter engines, draft/verify loop) → ``postprocessing``
(detokenise), chained by the ``ensemble`` model. Each model's ``config.pbtxt`` is rendered
from the ``config.pbtxt.in`` template kept next to its code in the source checkout's ``triton_repo/``
(``string.Template`` placeholders such as ``${engines_dir}``); the caller says where that folder is
(``template_dir``; the CLI and ``make`` run in the checkout, so ``./triton_repo``). Rendering into another
folder also copies the models' code there. Every file is written to a temporary name and renamed
into place.
"""

from __future__ import annotations

import re
from pathlib import Path
from string import Template

from splitspec.errors import ConfigError, SplitspecError
from splitspec.files import read_json, write_atomic
from splitspec.settings import MAX_QUEUE_S, PROMPT_BYTES_PER_TOKEN, ServeConfig

#: Models of the repository, in pipeline order (the ensemble last).
MODELS = ("preprocessing", "spec_decode", "postprocessing", "ensemble")
TEMPLATE_NAME = "config.pbtxt.in"
#: Largest max_tokens a request may ask for.
MAX_TOKENS_LIMIT = 4096
#: The templates' folder when the caller names none: ``triton_repo/`` of the working directory (the checkout's
#: root, where ``make`` and the CLI run).
TEMPLATE_DIR = Path("triton_repo")
#: Seconds between two ``is_cancelled()`` checks of one stream, in ``spec_decode`` (requests sent to it directly)
#: and ``postprocessing`` (ensemble streams). Each check is an IPC round trip between the Python backend's stub
#: and tritonserver: postprocessing never checks a stream's first response, spec_decode checks after sending a
#: response, not before it.
CANCEL_POLL_S = 0.05


def check_template_dir(template_dir: Path) -> Path:
    """``template_dir`` resolved, once it holds every model's ``config.pbtxt.in``.

    Raises:
        ConfigError: a template is missing; the message says what to pass.
    """
    root = Path(template_dir).resolve()
    for model in MODELS:
        if not (root / model / TEMPLATE_NAME).is_file():
            raise ConfigError(f"{root / model / TEMPLATE_NAME}: model repository template not found; pass "
                              "template_dir, the source checkout's triton_repo/ folder (or run from the checkout)")
    return root


def _engine_json(path: Path) -> dict:
    return read_json(path, "the engine description: build the engines first, 'make engines'", ConfigError)


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


def render_repo(cfg: ServeConfig, out_dir: Path, template_dir: Path = TEMPLATE_DIR) -> Path:
    """Write the model repository for the deployment ``cfg`` to ``out_dir``: ``cfg``'s
    :data:`~splitspec.settings.PARAMETER_FIELDS` become ``spec_decode``'s parameters.

    Args:
        cfg: the deployment. ``engines_dir`` holds ``target/`` and ``drafter/`` (each with ``engine.json``;
            the tokenizer files in ``target/``). ``num_draft_tokens`` None: the k per batch bucket of
            ``engines_dir/tuning.json`` (``splitspec tune``) when every bucket was tuned for the placement
            served (the parameter is then left empty and the engine reads the file), else 4. ``draft_tp`` None:
            tuning.json's placement per batch bucket (left empty when the buckets' placements differ: the
            engine loads both), else 1. ``target_device_ids`` ``()``: CPU; ``draft_device_id`` None: target rank
            0's device. ``max_batch_size`` / ``kv_tokens`` None: the engine's. ``max_prompt_bytes`` None: the
            target's max_seq_len × :data:`~splitspec.settings.PROMPT_BYTES_PER_TOKEN` (preprocessing's parameter).
            ``max_queue_s`` None: :data:`~splitspec.settings.MAX_QUEUE_S`. ``synthetic_acceptance``: BENCHMARK
            ONLY — served outputs are then NOT the target's (the engine labels them synthetic and the model logs
            a warning).
        out_dir: repository folder; ``template_dir`` itself renders in place, any other folder also
            receives a copy of the models' code.
        template_dir: the checkout's ``triton_repo/`` (templates and model code); relative to the working
            directory.
    Returns:
        ``out_dir`` resolved.
    Raises:
        ConfigError: a template, an engine or tokenizer file is missing, ``out_dir`` cannot be written, or a
            setting does not fit the engines (the message names it).
    """
    src = check_template_dir(template_dir)
    engines_dir = cfg.engines_dir.resolve()
    out_dir = Path(out_dir).resolve()
    if out_dir.is_dir() and any(out_dir.iterdir()) and not any((out_dir / m).exists() for m in MODELS):
        raise ConfigError(f"{out_dir}: a folder that holds other files and no model repository; name a new or empty "
                          "folder, or an earlier repository to render again")
    target = _engine_json(engines_dir / "target" / "engine.json")
    drafter = _engine_json(engines_dir / "drafter" / "engine.json")
    _check_tokenizer(engines_dir / "target", cfg.trust_remote_code)

    from splitspec.runtime.placement import read_tuning

    tuning = read_tuning(engines_dir)  # refused here, naming the file, if it does not fit these engines
    num_draft_tokens, draft_tp = cfg.num_draft_tokens, cfg.draft_tp
    max_draft = _find_int(drafter, "max_draft_len") or _find_int(target, "max_draft_len")
    if max_draft is not None and num_draft_tokens is not None and num_draft_tokens > max_draft:
        raise ConfigError(f"num_draft_tokens (-k) = {num_draft_tokens} exceeds the engines' max_draft_len "
                          f"{max_draft} ({engines_dir}); rebuild with a larger --max-draft-len")
    tgt_ids = cfg.target_device_ids
    draft_tp_given = draft_tp is not None
    tuned = set(tuning["draft_tp_by_batch"].values()) if tuning else {1}
    per_bucket = draft_tp is None and len(tuned) > 1  # "": the engine follows tuning.json bucket by bucket
    if draft_tp is None and not per_bucket:
        (draft_tp,) = tuned
    # k: as given; else "" (the engine takes tuning.json's k per batch bucket) where tuning.json was made
    # for the placement(s) served; else 4
    if num_draft_tokens is None and not (tuning and (per_bucket or tuned == {draft_tp})):
        num_draft_tokens = 4
    tp = _find_int(target, "tp_size")
    if tp is not None:
        if tgt_ids and len(tgt_ids) != tp:
            raise ConfigError(f"target_device_ids = {','.join(map(str, tgt_ids))!r} lists {len(tgt_ids)} GPUs, but the "
                              f"target engine has tp_size {tp} ({engines_dir / 'target' / 'engine.json'})")
        if not per_bucket and draft_tp not in (1, tp):
            raise ConfigError(f"draft_tp = {draft_tp}: expected 1 (own device) or the target's tp_size {tp}")
    if not per_bucket and draft_tp > 1 and cfg.draft_device_id is not None:
        where = "" if draft_tp_given else f" (draft_tp {draft_tp} from {engines_dir / 'tuning.json'})"
        raise ConfigError(f"draft_device_id applies to a TP1 drafter only; with draft_tp > 1{where} the drafter "
                          "runs on target_device_ids")
    if cfg.synthetic_acceptance is not None and not cfg.synthetic_acceptance:
        raise ConfigError("synthetic_acceptance = []: expected a non-empty list of probabilities in [0, 1]")

    max_prompt_bytes = cfg.max_prompt_bytes
    if max_prompt_bytes is None:
        seq = _find_int(target, "max_seq_len")
        if seq is None:
            raise ConfigError(f"{engines_dir / 'target' / 'engine.json'}: no max_seq_len to derive max_prompt_bytes "
                              "from; give max_prompt_bytes")
        max_prompt_bytes = seq * PROMPT_BYTES_PER_TOKEN
    served = cfg.replace(engines_dir=engines_dir, num_draft_tokens=num_draft_tokens,
                         draft_tp=None if per_bucket else draft_tp, max_prompt_bytes=max_prompt_bytes,
                         max_queue_s=MAX_QUEUE_S if cfg.max_queue_s is None else cfg.max_queue_s)
    values = served.to_parameters() | {"tokenizer_dir": str(engines_dir / "target"),
                                       "max_tokens_limit": str(MAX_TOKENS_LIMIT)}
    for k, v in values.items():
        if '"' in v or "\\" in v or "\n" in v:
            raise ConfigError(f"{k} = {v!r}: quotes, backslashes and newlines cannot go into config.pbtxt")

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


def _check_tokenizer(folder: Path, trust_remote_code: bool) -> None:
    """Refuse a target engine without the tokenizer files the pre/postprocessing models load (ConfigError)."""
    from splitspec.runtime.tokenizer import (TIKTOKEN_MODEL, TOKENIZER_CONFIG, TOKENIZER_JSON, read_tokenizer_config,
                                             remote_tokenizer_class, tokenizer_file)

    if not (folder / TOKENIZER_CONFIG).is_file():
        raise ConfigError(f"{folder / TOKENIZER_CONFIG}: tokenizer file missing from the target engine")
    if tokenizer_file(folder) is None:
        try:
            remote = remote_tokenizer_class(read_tokenizer_config(folder))
        except SplitspecError as e:
            raise ConfigError(str(e)) from None
        if not (remote and trust_remote_code):
            raise ConfigError(f"{folder}: no {TOKENIZER_JSON} or {TIKTOKEN_MODEL} in the target engine"
                              + (f" (its tokenizer is Python code, {remote}: add --trust-remote-code to run it)"
                                 if remote else ""))


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
