"""Train the demo pair: a small Kimi-K2-architecture target and its EAGLE-3 drafter, deterministically.

:func:`make_demo_models` (``splitspec demo-models``) writes the trained pair, taken from the cache or
trained first, or with ``trained=False`` a random one (:func:`splitspec.demo.checkpoints.write_random_pair`).

Pipeline (:func:`train_pair`), everything seeded from ``TrainConfig.seed`` (:mod:`splitspec.demo.train_config`):

1. **Corpus** (:mod:`splitspec.demo.corpus`). The Python standard library's ``.py`` sources, minus the
   codec tables under ``encodings/``; every ``heldout_every``-th file is held out for the held-out loss
   and the acceptance report. Chat-style samples are built from the training files' documented
   functions: "write a function that <docstring>" → the function's code, and "what does <function>
   do?" → its docstring, rendered with the Kimi-style chat template. The byte-level BPE tokenizer is
   trained on the same sources (:mod:`splitspec.demo.tokenizer_train`).
2. **Target** (:mod:`splitspec.demo.train_target`). transformers' ``DeepseekV3ForCausalLM`` (the
   independent reference implementation of the architecture) is trained with next-token cross-entropy
   on windows of the token stream. The ``noaux_tc`` router's ``e_score_correction_bias`` is trained
   with DeepSeek-V3's auxiliary-loss-free balancing rule (DeepSeek-V3 technical report,
   arXiv:2412.19437, §2.1.2): after every step, ``b_e += γ · sign(mean load − load_e)`` per MoE layer,
   loads counted over the step's tokens. The result is rounded to bf16, the published dtype, and that
   rounded model is used from then on.
3. **Self-distillation data.** The rounded target continues code windows and chat questions greedily;
   the drafter learns on these sequences (what speculation sees) plus plain corpus windows.
4. **Drafter** (:mod:`splitspec.demo.train_drafter`). An EAGLE-3 drafter (Li et al. 2025,
   arXiv:2503.01840) over the target's aux hidden states (inputs to layers ``aux_layer_ids``) with a
   reduced draft vocabulary (most frequent tokens), trained by distillation (cross-entropy against the
   target's softmax restricted to the draft vocabulary) with EAGLE-3's *training-time test* over
   ``ttt_steps`` steps.
5. **Export and report.** Both are written in the published Hugging Face formats
   (:mod:`splitspec.demo.checkpoints`), the acceptance by draft position is measured with the real
   engines (:mod:`splitspec.demo.acceptance`: convert → build → ``SpeculativeEngine``) on held-out
   prompts, and PNGs of the loss curves and of acceptance by position are saved next to the models
   (:mod:`splitspec.demo.report`).

Results are cached by content hash (:mod:`splitspec.demo.cache`: training code, config, seed, corpus
contents, library versions) under ``$SPLITSPEC_CACHE`` (default ``~/.cache/splitspec``) as
``demo-<hash>/`` (:func:`ensure_trained_pair`), so a machine trains once.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitspec.build.engines import build_pair
from splitspec.demo.acceptance import heldout_prompts, speculative_acceptance
from splitspec.demo.cache import (TRAINING_INFO, cache_key, cache_root, file_lock, install_trained_pair,
                                  library_versions)
from splitspec.demo.checkpoints import (VOCAB_SIZE, write_drafter_checkpoint, write_random_pair,
                                       write_target_checkpoint)
from splitspec.demo.corpus import WindowSampler, build_token_stream, corpus_split
from splitspec.demo.report import ACCEPTANCE_PNG, LOSS_PNG, log, print_summary, save_plots
from splitspec.demo.tokenizer_train import select_draft_vocab, train_tokenizer
from splitspec.demo.train_config import (TrainConfig, check_config, deterministic_mode, trained_drafter_config,
                                         trained_target_config)
from splitspec.demo.train_drafter import Eagle3Trainable, compute_teacher, train_drafter
from splitspec.demo.train_target import (build_target, greedy_continuations, round_to_published, target_heldout_loss,
                                         target_published_tensors, train_target)
from splitspec.files import atomic_dir, default_permissions
from splitspec.runtime.tokenizer import BOS_TOKEN, EOS_TOKEN, IM_END_TOKEN, PAD_TOKEN, ChatTokenizer


_README = """\
# Demo models (trained)

Two small checkpoints trained on this machine from seed {seed} by `splitspec demo-models`
(`splitspec.demo.pair`, cache key `{key}`):

- `target/`: a Kimi-K2-format Hugging Face checkpoint (`model_type: kimi_k2`, architecture
  `DeepseekV3ForCausalLM`): {n_layers} layers of MLA attention with YaRN, the first dense and the rest
  Mixture-of-Experts ({n_experts} routed experts, {top_k} per token, one shared expert, `noaux_tc` sigmoid
  router whose `e_score_correction_bias` was trained with DeepSeek-V3's auxiliary-loss-free balancing rule);
  {target_params:,} parameters in bf16. Trained with transformers' `DeepseekV3ForCausalLM` for
  {target_steps} steps ({target_tokens:,} tokens) on the Python standard library's sources plus chat
  samples built from its docstrings, using the {vocab}-token BPE tokenizer and the Kimi-style chat template.
  Final training loss {target_loss:.3f} nats/token; held-out loss {heldout:.3f} nats/token
  ({n_heldout} held-out stdlib files).
- `drafter/`: an EAGLE-3 drafter (`LlamaForCausalLMEagle3`: one `midlayer`, `fc` over the target's inputs
  to layers {aux} (`aux_layer_id_convention: input`), {draft_vocab}-token draft vocabulary with `d2t`/`t2d`,
  no embedding; {drafter_params:,} parameters), distilled from the target's logits on {n_seqs} sequences
  (mostly the target's own greedy continuations) with EAGLE-3's training-time test over {ttt} steps,
  {drafter_steps} steps. Final loss {drafter_loss:.3f}.

Speculative decoding with the real engines on {n_prompts} held-out prompts, greedy, k = {k}:
mean acceptance length **{acc_len:.2f}** tokens per target forward; accepted by draft position
{per_pos}. Plots: `{loss_png}`, `{acc_png}`; full numbers: `{info}`.
"""


def train_pair(out_dir: Path, cfg: TrainConfig, progress: bool = True, measure: bool = True,
               key: str | None = None) -> dict[str, Any]:
    """Train the demo pair and write it to ``out_dir`` (built in a temporary sibling folder, then
    renamed into place; an existing ``out_dir`` is replaced only on success).

    Layout: ``target/`` and ``drafter/`` in the published formats (as :func:`make_demo_models` writes
    them), ``README.md``, :data:`TRAINING_INFO` (config, cache key, loss histories, held-out loss,
    acceptance, timings) and the PNGs :data:`LOSS_PNG` / :data:`ACCEPTANCE_PNG`.

    Args:
        out_dir: destination folder.
        cfg: what to train (:meth:`TrainConfig.preset` for the demo; small step counts for tests).
        progress: show tqdm bars and loss lines.
        measure: measure acceptance with the real engines on held-out prompts after training.
        key: cache key recorded in the report (default: :func:`cache_key` of ``cfg``).

    Returns:
        The report written to :data:`TRAINING_INFO`.

    Raises:
        ConfigError: an invalid configuration, an unavailable device, or ``out_dir`` an existing file.
    """
    check_config(cfg)
    with atomic_dir(Path(out_dir)) as tmp:
        with deterministic_mode(cfg):
            report = _train_into(tmp, cfg, progress, measure, key)
        default_permissions(tmp)
    return report


def _train_into(root: Path, cfg: TrainConfig, progress: bool, measure: bool, key: str | None) -> dict[str, Any]:
    """Body of :func:`train_pair`, writing into the (temporary) folder ``root``."""
    t_start = time.perf_counter()
    device = torch.device(cfg.device)
    timings: dict[str, float] = {}
    target_dir, drafter_dir = root / "target", root / "drafter"
    target_dir.mkdir()
    drafter_dir.mkdir()

    # ---- data
    t = time.perf_counter()
    log(f"training byte-level BPE tokenizer ({VOCAB_SIZE} tokens) on the Python standard library sources")
    train_tokenizer(target_dir, vocab_size=VOCAB_SIZE)
    tok = ChatTokenizer.from_dir(target_dir)
    bos, eos, pad, im_end = (tok.token_to_id(x) for x in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_END_TOKEN))
    stop_ids = [eos, im_end]
    split = corpus_split(cfg.heldout_every, cfg.max_corpus_files)
    key = key or cache_key(cfg, split)
    stream, chat_prompts = build_token_stream(tok, split, cfg.seed, cfg.chat_fraction)
    timings["data_s"] = time.perf_counter() - t
    log(f"corpus: {len(split.train)} training files + chat samples = {len(stream):,} tokens; "
        f"{len(split.heldout)} held-out files ({timings['data_s']:.1f} s)")

    # ---- target
    tcfg = trained_target_config(cfg, bos, eos, pad)
    model = build_target(tcfg, cfg.seed, device)
    n_tok = cfg.target_steps * cfg.target_batch_size * cfg.target_seq_len
    log(f"training the target (transformers DeepseekV3ForCausalLM, {tcfg['num_hidden_layers']} layers, "
        f"{tcfg['n_routed_experts']} experts, {sum(p.numel() for p in model.parameters()):,} parameters) on {cfg.device}: "
        f"{cfg.target_steps} steps × {cfg.target_batch_size} × {cfg.target_seq_len} tokens = {n_tok:,} tokens")
    thist = train_target(model, WindowSampler(stream, cfg.target_seq_len, cfg.target_batch_size, cfg.seed), cfg, progress)
    timings["target_s"] = thist["seconds"]
    round_to_published(model)
    target_params = write_target_checkpoint(target_dir, tcfg, target_published_tensors(model), stop_ids)
    t = time.perf_counter()
    heldout = target_heldout_loss(model, tok, [x for _, x in split.heldout], cfg.target_seq_len)
    biases = [layer.mlp.gate.e_score_correction_bias.detach().cpu() for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    timings["heldout_s"] = time.perf_counter() - t
    log(f"target: final training loss {np.mean(thist['loss'][-cfg.log_every:]):.3f}, held-out loss {heldout:.3f} "
        f"nats/token; correction bias range [{min(float(b.min()) for b in biases):+.3f}, "
        f"{max(float(b.max()) for b in biases):+.3f}] ({thist['seconds']:.0f} s)")

    # ---- draft vocabulary and self-distillation data
    t = time.perf_counter()
    counts = np.bincount(stream, minlength=tok.vocab_size)
    draft_ids = torch.from_numpy(select_draft_vocab(counts, cfg.draft_vocab_size, always_include=stop_ids))
    coverage = float(counts[draft_ids.numpy()].sum() / counts.sum())
    rng = np.random.default_rng([cfg.seed, 4])
    P = cfg.distill_prompt_tokens
    starts = rng.integers(0, len(stream) - P - 1, size=cfg.distill_code_prompts)
    prompts = [stream[s:s + P].tolist() for s in starts]
    prompts += [p for p in chat_prompts if len(p) <= 4 * P][: cfg.distill_chat_prompts]
    log(f"self-distillation: greedy continuations ({cfg.distill_new_tokens} tokens) of {len(prompts)} prompts")
    sequences = greedy_continuations(model, prompts, cfg.distill_new_tokens, stop_ids, pad, cfg.generate_batch_size, progress)
    starts = rng.integers(0, len(stream) - P - cfg.distill_new_tokens, size=cfg.distill_corpus_windows)
    sequences += [stream[s:s + P + cfg.distill_new_tokens].tolist() for s in starts]
    timings["distill_data_s"] = time.perf_counter() - t
    log(f"draft vocabulary: {cfg.draft_vocab_size} most frequent tokens cover {coverage:.1%} of the corpus; "
        f"{len(sequences)} drafter training sequences ({timings['distill_data_s']:.0f} s)")

    # ---- drafter
    dcfg = trained_drafter_config(cfg, bos, eos)
    drafter = Eagle3Trainable(dcfg, model.model.embed_tokens.weight.detach().cpu(), cfg.seed + 1,
                              lm_head_init=model.lm_head.weight.detach().cpu()[draft_ids]).to(device)
    log(f"training the EAGLE-3 drafter (aux = inputs to target layers {list(cfg.aux_layer_ids)}, "
        f"training-time test over {cfg.ttt_steps} steps): {cfg.drafter_steps} steps × {cfg.drafter_batch_size} sequences")
    for p in model.parameters():
        p.requires_grad_(False)
    t = time.perf_counter()
    teacher = compute_teacher(model, sequences, tuple(cfg.aux_layer_ids), draft_ids, cfg.generate_batch_size // 4 or 1,
                              pad, progress)
    timings["teacher_s"] = time.perf_counter() - t
    dhist = train_drafter(drafter, teacher, draft_ids, cfg, progress)
    del teacher
    timings["drafter_s"] = dhist["seconds"]
    drafter_params = write_drafter_checkpoint(drafter_dir, dcfg, drafter.published_tensors(), draft_ids)

    report: dict[str, Any] = {
        "format": "splitspec-demo-training-v1", "key": key, "config": cfg.to_dict(),
        "versions": library_versions(),
        "target": {"params": target_params, "tokens": n_tok, "loss": thist["loss"], "imbalance": thist["imbalance"],
                   "final_loss": float(np.mean(thist["loss"][-cfg.log_every:])), "heldout_loss": heldout,
                   "heldout_files": [r for r, _ in split.heldout],
                   "correction_bias": [[float(x) for x in b] for b in biases]},
        "drafter": {"params": drafter_params, "sequences": len(sequences), "loss": dhist["loss"],
                    "step_loss": dhist["step_loss"], "step_acc": dhist["step_acc"],
                    "final_loss": float(np.mean(dhist["loss"][-cfg.log_every:])),
                    "final_step_acc": [float(a) for a in np.mean(dhist["step_acc"][-cfg.log_every:], axis=0)],
                    "draft_vocab_coverage": coverage},
        "acceptance": None, "timings": timings,
    }

    # ---- acceptance with the real engines
    if measure:
        t = time.perf_counter()
        eval_prompts = heldout_prompts(tok, split, cfg.eval_prompts, cfg.distill_prompt_tokens)
        with tempfile.TemporaryDirectory(prefix="splitspec-engines-") as eng_tmp:
            engines = build_pair(root, Path(eng_tmp), quiet=True)
            dev_ids = [device.index or 0] if device.type == "cuda" else None
            acc = speculative_acceptance(engines, eval_prompts, cfg.eval_new_tokens, cfg.eval_draft_tokens, stop_ids,
                                         dev_ids, check_lossless=True, progress=progress)
        acc["samples"] = [{"prompt": tok.decode(p, skip_special_tokens=False), "output": tok.decode(o, skip_special_tokens=False)}
                          for p, o in list(zip(eval_prompts, acc.pop("outputs")))[:3]]
        acc["prompts"] = len(eval_prompts)
        report["acceptance"] = acc
        timings["acceptance_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_start

    # ---- report
    (root / TRAINING_INFO).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    pngs = save_plots(report, root)
    acc = report["acceptance"] or {"k": cfg.eval_draft_tokens, "acceptance_length": float("nan"), "per_position": [], "prompts": 0}
    (root / "README.md").write_text(_README.format(
        seed=cfg.seed, key=key, n_layers=tcfg["num_hidden_layers"], n_experts=tcfg["n_routed_experts"],
        top_k=tcfg["num_experts_per_tok"], target_params=target_params, target_steps=cfg.target_steps,
        target_tokens=n_tok, vocab=VOCAB_SIZE, target_loss=report["target"]["final_loss"], heldout=heldout,
        n_heldout=len(split.heldout), aux=list(cfg.aux_layer_ids), draft_vocab=cfg.draft_vocab_size,
        drafter_params=drafter_params, n_seqs=len(sequences), ttt=cfg.ttt_steps, drafter_steps=cfg.drafter_steps,
        drafter_loss=report["drafter"]["final_loss"], n_prompts=acc["prompts"], k=acc["k"],
        acc_len=acc["acceptance_length"], per_pos=", ".join(f"{i + 1}: {a:.2f}" for i, a in enumerate(acc["per_position"])),
        loss_png=LOSS_PNG if LOSS_PNG in pngs else "(matplotlib missing)",
        acc_png=ACCEPTANCE_PNG if ACCEPTANCE_PNG in pngs else "(not measured)", info=TRAINING_INFO), encoding="utf-8")
    print_summary(report)
    return report


def ensure_trained_pair(cfg: TrainConfig, cache_dir: Path | None = None, retrain: bool = False,
                        progress: bool = True) -> Path:
    """Return the cache folder ``demo-<key>`` holding the pair trained with ``cfg``, training it first
    when it is missing (or when ``retrain``).

    Args:
        cfg: the training configuration.
        cache_dir: cache root (default :func:`cache_root`).
        retrain: train again even when the entry exists.
        progress: show progress while training.

    Raises:
        ConfigError: invalid configuration or unavailable device.
    """
    check_config(cfg)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    key = cache_key(cfg)
    entry = root / f"demo-{key}"
    with file_lock(root / f".demo-{key}.lock"):
        if (entry / TRAINING_INFO).is_file() and not retrain:
            log(f"using the trained demo pair cached in {entry}")
            return entry
        log(f"training the demo pair (cache key {key}) into {entry}")
        train_pair(entry, cfg, progress=progress, key=key)
    return entry


def make_demo_models(out_dir: Path, seed: int = 0, trained: bool = False, device: str = "cpu",
                     retrain: bool = False, progress: bool = True) -> None:
    """Write the demo target, drafter, tokenizer and README into ``out_dir``.

    With ``trained=False`` (the default, used by the numerics tests) the weights are random
    (:func:`splitspec.demo.checkpoints.write_random_pair`). With ``trained=True`` the pair trained with
    ``TrainConfig.preset(device, seed)`` is taken from the cache (``$SPLITSPEC_CACHE``, default
    ``~/.cache/splitspec``), trained there first if missing (minutes; :func:`ensure_trained_pair`), and
    copied to ``out_dir`` unless ``out_dir`` already holds it; the folder then also holds
    ``training.json`` and PNG plots. Either way ``out_dir`` is replaced only once the new one is complete.

    Args:
        out_dir: destination folder.
        seed: seed of the torch generators (random: target ``seed``, drafter ``seed + 1``; trained:
            the training seed).
        trained: write the trained pair instead of random weights.
        device: trained pair only: ``cpu`` or ``cuda[:N]`` (a larger pair on a GPU).
        retrain: trained pair only: train again even when the cache holds the pair.
        progress: trained pair only: show progress bars and loss lines while training.

    Raises:
        ConfigError: ``out_dir`` exists and is not a folder; an unknown or unavailable device.
    """
    if not trained:
        write_random_pair(Path(out_dir), seed)
        return
    entry = ensure_trained_pair(TrainConfig.preset(device, seed), retrain=retrain, progress=progress)
    if install_trained_pair(entry, Path(out_dir)):
        log(f"copied the trained pair {entry.name} to {out_dir}")
    else:
        log(f"{out_dir} already holds the trained pair {entry.name}")
