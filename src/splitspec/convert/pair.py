"""Convert: read a published target + EAGLE-3 drafter pair in any of its real formats, check that they fit,
write rank-sharded checkpoints.

The two sides: :mod:`splitspec.convert.target` (target forms, TP/EP slicing) and :mod:`splitspec.convert.drafter`
(drafter tensors, vocabulary mapping, embedding); the forms read and written are in docs/formats.md.

Output layout (``checkpoints/<name>/``)::

    target/config.json            {"format", "kind": "target", "config", "mapping", "quantization", "source"}
    target/rank{i}.safetensors    Hugging Face tensor names without any nesting prefix, sliced for rank i;
                                  FP8 linears as ``X.weight`` (float8_e4m3fn) + ``X.weight_scale_inv``; INT4
                                  routed experts as published: ``X.weight_packed`` / ``X.weight_scale`` slices
                                  + the slice's ``X.weight_shape``
    target/tokenizer files        copied from the target checkpoint
    drafter/config.json           {"format", "kind": "drafter", "config", "capture_points", "embedding", "quantization", ...}
    drafter/rank0.safetensors     drafter tensors, ``draft_to_target`` and the chosen ``embed_tokens.weight``; an FP8
                                  drafter's linears as ``X.weight`` (float8_e4m3fn) + ``X.weight_scale_inv``

Streaming: tensors are read one at a time with positioned reads (:class:`splitspec.convert.safetensors.CheckpointReader`)
and written one at a time (:class:`splitspec.convert.safetensors.StreamingSafetensorsWriter`), so resident memory is the
largest source tensor plus its slice, far below the largest shard plus one rank's output. Every tensor
in either checkpoint is used, deliberately skipped (with a notice), or reported as unused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tqdm import tqdm

from splitspec.config import Mapping, TargetConfig
from splitspec.drafter_config import DrafterConfig
from splitspec.convert.drafter import check_drafter_tensors, drafter_scheme, drafter_tensors
from splitspec.convert.safetensors import CheckpointReader, write_tensors
from splitspec.convert.target import TargetSource, rank_tensor_count, target_rank_tensors
from splitspec.errors import CheckpointError, ConfigError
from splitspec.convert.tiktoken_file import read_ranks, special_tokens
from splitspec.files import atomic_dir, read_json, write_json

FORMAT = "splitspec-checkpoint-v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "tiktoken.model", "chat_template.jinja")


def tokenizer_files(folder: Path) -> list[str]:
    """The tokenizer files of ``folder`` a conversion carries along: those of :data:`TOKENIZER_FILES` present, plus
    any ``tokenization_*.py`` module, copied as data (only an explicit ``--trust-remote-code`` ever runs it)."""
    folder = Path(folder)
    return [f for f in TOKENIZER_FILES if (folder / f).is_file()] + sorted(p.name for p in folder.glob("tokenization_*.py"))


def check_pair(target: TargetConfig, drafter: DrafterConfig, drafter_dir: Path) -> None:
    """Check that the drafter fits the target.

    Raises:
        CheckpointError: naming the drafter config field that disagrees (target_hidden_size,
            vocab_size, draft_vocab_size, aux layer ids out of range).
        ConfigError: the aux-id convention is unknown.
    """
    where = drafter_dir / "config.json"
    if drafter.target_hidden_size != target.hidden_size:
        field = "target_hidden_size" if drafter.target_hidden_size != drafter.hidden_size else "hidden_size (no target_hidden_size)"
        raise CheckpointError(f"{where}: {field} = {drafter.target_hidden_size}, but the target's hidden_size is {target.hidden_size}")
    if drafter.vocab_size != target.vocab_size:
        raise CheckpointError(f"{where}: vocab_size = {drafter.vocab_size}, but the target's vocab_size is {target.vocab_size}")
    if drafter.draft_vocab_size > drafter.vocab_size:
        raise CheckpointError(f"{where}: draft_vocab_size = {drafter.draft_vocab_size} exceeds vocab_size = {drafter.vocab_size}")
    n = target.num_hidden_layers
    for i, point in zip(drafter.aux_layer_ids, drafter.capture_points()):
        if point > n:
            last = n if drafter.aux_convention == "input" else n - 1
            raise CheckpointError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids contains {i}, out of range for a "
                                  f"{n}-layer target under the '{drafter.aux_convention}' convention (largest valid id: {last})")


def tokenizer_vocab_size(folder: Path) -> tuple[int, str] | None:
    """Token count of a checkpoint's tokenizer (highest id + 1) and the file it came from, or None without one.

    Reads ``tokenizer.json`` with the ``tokenizers`` library, or a tiktoken ``tiktoken.model`` and the special tokens
    of ``tokenizer_config.json`` (:mod:`splitspec.convert.tiktoken_file`: a malformed line or field is a one-line
    CheckpointError, before anything is written).
    """
    folder = Path(folder)
    if (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:
            raise CheckpointError(f"{folder / 'tokenizer.json'}: cannot be read by the tokenizers library ({e})") from None
        ids = list(tok.get_vocab(with_added_tokens=True).values())
        return (max(ids) + 1 if ids else 0), "tokenizer.json"
    if (folder / "tiktoken.model").exists():  # parsed and checked as the runtime reads it (tiktoken_file.py)
        n = len(read_ranks(folder / "tiktoken.model"))
        specials, _ = special_tokens(read_json(folder / "tokenizer_config.json", "the tokenizer's special tokens"), n,
                                     str(folder / "tokenizer_config.json"))
        return max(n, max(specials.values()) + 1), "tiktoken.model"
    return None


def check_tokenizer(folder: Path, vocab_size: int) -> None:
    """Raise CheckpointError when the checkpoint's tokenizer can produce ids the model has no row for."""
    got = tokenizer_vocab_size(folder)
    if got is not None and got[0] > vocab_size:
        raise CheckpointError(f"{Path(folder) / got[1]}: the tokenizer has {got[0]} token ids but config.json's vocab_size is "
                              f"{vocab_size}; ids ≥ {vocab_size} would index past the embedding")


def convert_pair(target_dir: Path, drafter_dir: Path, out: Path, tp_size: int = 2, ep_size: int = 1,
                 aux_convention: str | None = None, drafter_embedding: str | None = None, progress: bool = True,
                 int4_reference: Path | None = None) -> Path:
    """Check a target/drafter pair and write ``out/target`` (TP-``tp_size`` shards) and ``out/drafter`` (TP1).

    Args:
        target_dir: Hugging Face Kimi-K2 / K2.5 / DeepSeek-V3 checkpoint folder (bf16, FP8 or INT4).
        drafter_dir: Hugging Face EAGLE-3 drafter folder.
        out: output folder, replaced atomically on success.
        tp_size, ep_size: target mapping (see :class:`splitspec.config.Mapping`).
        aux_convention: "input" or "output", when the drafter's config does not declare it.
        drafter_embedding: None (decide, see :func:`drafter_tensors`), "target" or "own".
        progress: show tqdm progress bars.
        int4_reference: a float checkpoint of the same weights as an INT4 target, for the known-value check of its
            nibble order (:meth:`splitspec.convert.target.TargetSource.check_nibble_order`); None: not checked.
    Returns: ``out``.
    Raises:
        CheckpointError / ConfigError: a clear message naming the file, tensor or field; ``out`` untouched.
    """
    target_dir, drafter_dir, out = Path(target_dir), Path(drafter_dir), Path(out)
    if drafter_embedding not in (None, "target", "own"):
        raise ConfigError(f"drafter_embedding = {drafter_embedding!r}, expected 'target' or 'own'")
    src = TargetSource(target_dir)
    tcfg = src.cfg
    draw = read_json(drafter_dir / "config.json")
    dcfg = DrafterConfig.from_hf(draw, str(drafter_dir / "config.json"), aux_convention)
    dscheme = drafter_scheme(draw, str(drafter_dir / "config.json"))
    tied = bool((draw.get("eagle_config") or {}).get("share_target_embedding", draw.get("share_target_embedding", False)))
    mapping = Mapping(tp_size=tp_size, ep_size=ep_size)
    mapping.check(tcfg, where=f"target {target_dir} at tp_size={tp_size}")
    check_pair(tcfg, dcfg, drafter_dir)
    check_tokenizer(target_dir, tcfg.vocab_size)
    if src.scheme.method == "int4":
        src.check_int4_split(mapping)
        if int4_reference is not None:
            print(src.check_nibble_order(Path(int4_reference)))
    elif int4_reference is not None:
        raise ConfigError(f"int4_reference given, but {target_dir} holds {src.scheme.describe()}")
    dreader = CheckpointReader(drafter_dir)
    try:
        check_drafter_tensors(dreader, dcfg, tcfg.hidden_size, dscheme)  # from the headers: a bad drafter fails before the target converts
        return _convert(src, dreader, dcfg, mapping, target_dir, drafter_dir, out, drafter_embedding, tied, progress, dscheme)
    finally:
        src.reader.close()
        dreader.close()


def _convert(src: TargetSource, dreader: CheckpointReader, dcfg: DrafterConfig, mapping: Mapping, target_dir: Path,
             drafter_dir: Path, out: Path, drafter_embedding: str | None, tied: bool, progress: bool, dscheme) -> Path:
    tcfg, tp_size, ep_size = src.cfg, mapping.tp_size, mapping.ep_size
    total = rank_tensor_count(tcfg, mapping)
    written = []
    with atomic_dir(out, keep=(target_dir, drafter_dir)) as tmp:
        (tmp / "target").mkdir()
        (tmp / "drafter").mkdir()
        for rank in range(tp_size):
            bar = tqdm(total=total, desc=f"convert target rank {rank + 1}/{tp_size}", unit="tensor", disable=not progress)

            def counted(items):
                for name, t in items:
                    if not name.endswith("_scale_inv"):
                        bar.update(1)
                    yield name, t

            try:
                written.append(write_tensors(counted(target_rank_tensors(src, tcfg, mapping, rank)),
                                             tmp / "target" / f"rank{rank}.safetensors"))
            finally:
                bar.close()
        qmeta = {"method": src.scheme.method,
                 "weight_block_size": list(src.scheme.block) if src.scheme.method == "fp8" else None,
                 "group_size": src.scheme.group_size, "source": src.scheme.describe(), "source_config": src.scheme.source,
                 "dequantized_at_convert": src.dequantized + src.int4_dequantized}
        write_json({"format": FORMAT, "kind": "target", "config": tcfg.to_dict(), "mapping": mapping.to_dict(),
                    "quantization": qmeta, "source": str(target_dir.resolve())}, tmp / "target" / "config.json")
        for f in tokenizer_files(target_dir):
            shutil.copy2(target_dir / f, tmp / "target" / f)
        dtensors, emb = drafter_tensors(dreader, dcfg, src, drafter_embedding, tied, dscheme)
        fp8 = sorted(n.removesuffix("_scale_inv") for n in dtensors if n.endswith(".weight_scale_inv"))
        write_tensors(dtensors.items(), tmp / "drafter" / "rank0.safetensors")
        capture = dcfg.describe_capture(tcfg.num_hidden_layers)
        dq = {"method": "fp8" if fp8 else "none", "weight_block_size": list(dscheme.block) if fp8 else None,
              "fp8_tensors": fp8, "source": dscheme.describe(), "source_config": dscheme.source}
        write_json({"format": FORMAT, "kind": "drafter", "config": dcfg.to_dict(), "quantization": dq, "embedding": emb["note"],
                    "embedding_source": emb["source"], "capture_points": list(dcfg.capture_points()), "capture": capture,
                    "aux_convention_source": dcfg.aux_convention_source, "source": str(drafter_dir.resolve())},
                   tmp / "drafter" / "config.json")
    unused = [f"target:{n}" for n in src.reader.unused()] + [f"drafter:{n}" for n in dreader.unused()]
    n = tcfg.num_hidden_layers
    print(f"converted target {target_dir} ({tcfg.model_type}, {n} layers, hidden {tcfg.hidden_size}, "
          f"{tcfg.n_routed_experts} experts; weights: {src.scheme.describe()}) → {out}/target at TP{tp_size} (EP{ep_size}), "
          f"{sum(written) / 2**20:.1f} MiB in {tp_size} shard(s)")
    if src.skipped:
        print(f"notice: skipped {len(src.skipped)} vision tensors (vision_tower.*, mm_projector.*): the vision part of "
              f"{tcfg.model_type} is out of scope; only the text model is converted")
    if src.scheme.method == "int4":
        print(f"notice: INT4 routed experts kept as published (group {src.scheme.group_size}); 'splitspec build' keeps "
              "them (default, or --dtype int4) or dequantises them (a float --dtype)"
              + (f"; {len(src.int4_dequantized)} other INT4 linears dequantised to bfloat16" if src.int4_dequantized else ""))
    if src.dequantized:
        print(f"notice: {len(src.dequantized)} FP8 weights stored dequantised (bfloat16) because the TP{tp_size} split cuts "
              f"through their {src.scheme.block[0]}×{src.scheme.block[1]} tiles: {', '.join(src.dequantized[:6])}"
              + (" …" if len(src.dequantized) > 6 else ""))
    print(f"converted drafter {drafter_dir} ({dcfg.architecture}: {dcfg.describe_attention()}; draft vocab "
          f"{dcfg.draft_vocab_size}/{dcfg.vocab_size}; weights: {dscheme.describe()}) → {out}/drafter at TP1")
    print(f"  target states feeding the drafter ({dcfg.aux_convention} convention, {dcfg.aux_convention_source}): {capture}")
    extra = [x for x, on in (("RMSNorm over the concatenated aux states before fc (norm_before_fc)", dcfg.norm_before_fc),
                             ("one RMSNorm per aux state before fc (fc_norm)", dcfg.fc_norm)) if on]
    if extra:
        print(f"  drafter norms before fc: {'; '.join(extra)}")
    if dcfg.norm_output:
        print("  drafter state fed to the next step: after the final norm (norm_output)")
    if "lm_head.weight" not in dreader:
        print("  drafter lm_head: the target's (the drafter has none over the full vocabulary)")
    print(f"  drafter embedding: {emb['note']}")
    if unused:
        print(f"unused tensors ({len(unused)}): " + ", ".join(unused[:20]) + (" …" if len(unused) > 20 else ""))
    return out
