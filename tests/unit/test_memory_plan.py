"""`splitspec plan` on the published Kimi configs (config-only fixtures, tests/fixtures/published/README.md): Kimi-K2.5
INT4 at TP8 with its EAGLE-3 drafter at TP1 fits 141 GiB H200s and 96 GiB cards, dequantised to bf16 it is refused
with one line; item bytes agree with sizes worked out by hand from the published shapes; bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitspec.build.memory_plan import GIB
from splitspec.cli import main
from splitspec.files import read_json, write_json

FIXTURES = Path(__file__).parents[1] / "fixtures" / "published"
K25, DRAFTER = FIXTURES / "kimi-k2.5", FIXTURES / "drafter-aq-medai-kimi-k25-eagle3"
LIMITS = ["--max-batch-size", "8", "--max-seq-len", "4096", "--max-draft-len", "3"]


def plan(capsys, target: Path, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", str(target), *args])
    out, err = capsys.readouterr()
    return rc, out, err


def row(out: str, label: str) -> list[float]:
    """The GiB values of the table row ``label`` (one per GPU column)."""
    line = next(x for x in out.splitlines() if x.strip().startswith(label))
    return [float(v) for v in line[len(label) + 2:].replace("GiB", "").replace("—", "nan").split()]


@pytest.mark.parametrize("gib, batch", [(140.4, 8), (95.6, 4)])  # what an H200 and a "96 GB" card report
def test_k25_int4_tp8_with_tp1_drafter_fits(capsys, gib, batch, tmp_path):
    rc, out, err = plan(capsys, K25, "--drafter", str(DRAFTER), "--tp", "8", "--gpu-memory-gib", str(gib),
                        "--max-batch-size", str(batch), *LIMITS[2:], "--json", str(tmp_path / "plan.json"))
    assert rc == 0, err
    assert "int4 weights" in out and "drafter TP1 on GPU 0" in out and "fits: yes" in out
    assert f"KV budget: {batch * 4096} tokens ({batch} × 4096)" in out
    # the drafter lives on GPU 0 only: its rows are empty ("—") on the other GPUs
    gpu0, others = row(out, "drafter embeddings")
    assert gpu0 == pytest.approx(163840 * 7168 * 2 / GIB, abs=0.01) and others != others
    doc = read_json(tmp_path / "plan.json")
    assert doc["fits"] is True and len(doc["gpus"]) == 8
    assert all(g["total"] <= gib * GIB for g in doc["gpus"])
    assert doc["gpus"][0]["total"] > doc["gpus"][1]["total"]  # GPU 0 carries the drafter and its cache
    assert doc["gpus"][0]["kv_tokens_fit"] >= batch * 4096


def test_graph_pool_holds_every_k_up_to_max_draft_len(capsys):
    """Requests choose k ≤ max_draft_len and a steady batch of each k captures graphs of its own: raising the limit
    from 3 to 8 adds, on a GPU without the drafter, at least the new graphs' outputs — logits V float32 and aux 3H
    bf16 per row, rows b·(k + 1) for every bucket b ≤ 8 and k 4..8, in each of the 5 key windows 256..4096."""
    pools = []
    for k in ("3", "8"):
        rc, out, err = plan(capsys, K25, "--drafter", str(DRAFTER), "--tp", "8", "--gpu-memory-gib", "200",
                            "--max-batch-size", "8", "--max-seq-len", "4096", "--max-draft-len", k)
        assert rc == 0, err
        pools.append(row(out, "CUDA-graph pool")[1])
    added = (1 + 2 + 4 + 8) * sum(range(5, 10)) * (163840 * 4 + 3 * 7168 * 2) * 5 / GIB
    assert pools[1] - pools[0] >= added - 0.01 and added > 1.5


def test_draft_ahead_adds_a_draft_pool_on_gpu0_only(capsys):
    """``--draft-ahead``: the draft-ahead graphs' pool of their own holds one more draft's intermediates on GPU 0 —
    the drafter's K and V window gathers 2·b·S·kv·hd, its scores b·heads·n·S in float32 and bf16, and its draft-vocabulary
    logits twice in float32 (K2.5 drafter: 64 KV heads of 128, 32000 draft tokens; b 8, S 4096, n 4) — and
    nothing on GPUs 1–7."""
    pools, text = [], ""
    for ahead in ([], ["--draft-ahead"]):
        rc, out, err = plan(capsys, K25, "--drafter", str(DRAFTER), "--tp", "8", "--gpu-memory-gib", "200", *LIMITS, *ahead)
        assert rc == 0, err
        pools.append(row(out, "CUDA-graph pool"))
        text = out
    by_hand = (2 * 8 * 4096 * 64 * 128 * 2 + 8 * 64 * 4 * 4096 * (8 + 2) + 2 * 32 * 32000 * 4) / GIB
    assert pools[1][0] - pools[0][0] == pytest.approx(by_hand, abs=0.01) and pools[1][1] == pools[0][1]
    assert "draft-ahead" in text


@pytest.mark.parametrize("gib", [141, 96])
def test_k25_dequantised_to_bf16_is_refused_in_one_line(capsys, gib):
    rc, out, err = plan(capsys, K25, "--drafter", str(DRAFTER), "--tp", "8", "--gpu-memory-gib", str(gib), *LIMITS,
                        "--dtype", "bfloat16")
    assert rc == 2
    assert "fits: NO (8 of 8 GPUs over budget)" in out
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("splitspec plan: error: GPU 0 needs ")
    assert f"over its {gib:.1f} GiB budget (bfloat16 weights, TP8)" in lines[0] and "routed experts 236.2 GiB" in lines[0]


def test_k2_instruct_fp8_tp8_fits_h200s_with_its_experts_read_as_fp8(capsys):
    """FP8-kept experts past the fused kernels' 16 tokens take the W8A16 grouped kernels on a GPU: a prefill chunk's
    transients are its pairs' activations and outputs (T = 512 + 8 tokens: a prefill chunk and a decode step of
    each sequence, no drafter; 8 pairs each: act 256 bf16 + out 7168 float32 per pair, plus 8 bytes per token and
    hidden unit), not the 12 bytes per element of every expert's w13 that dequantising them would take (16.9 GB per
    GPU)."""
    rc, out, err = plan(capsys, FIXTURES / "kimi-k2-instruct", "--tp", "8", "--gpu-memory-gib", "140",
                        "--max-batch-size", "8", "--max-seq-len", "4096")
    assert rc == 0, err
    assert "fp8 weights" in out and "fits: yes" in out
    T = 512 + 8
    grouped = T * 8 * (2 * 256 + 4 * 7168) + 8 * T * 7168
    assert grouped / GIB < row(out, "activations (eager peak)")[0] < 1.0
    rc, out, err = plan(capsys, FIXTURES / "kimi-k2-instruct", "--tp", "8", "--gpu-memory-gib", "95.5",
                        "--max-batch-size", "8", "--max-seq-len", "4096")
    assert rc == 2 and "routed experts 118.2 GiB" in err


def test_bytes_agree_with_the_published_shapes_worked_by_hand(capsys, tmp_path):
    """Independent arithmetic: 60 MoE layers × 384 experts × (gate, up, down) of 2048 × 7168 per expert."""
    H, I, E, moe_layers, N = 7168, 2048, 384, 60, 8
    w = I // N  # each rank's slice of every expert (expert-TP 8)
    main(["plan", str(K25), "--drafter", str(DRAFTER), "--tp", "8", "--gpu-memory-gib", "141", *LIMITS,
          "--json", str(tmp_path / "int4.json")])
    main(["plan", str(FIXTURES / "kimi-k2-instruct"), "--tp", "8", "--gpu-memory-gib", "1000", *LIMITS,
          "--json", str(tmp_path / "fp8.json")])
    capsys.readouterr()
    items = lambda doc, g=0: {i["label"]: i["bytes"] for i in doc["gpus"][g]["items"]}  # noqa: E731
    int4, fp8 = items(read_json(tmp_path / "int4.json")), items(read_json(tmp_path / "fp8.json"))
    # INT4 (K2.5): each rank holds every expert's 1/8 slice: gate/up 256 rows, down 256 of the input columns;
    # packed int32 = 8 values per 4 bytes, one bf16 scale per 32 inputs (the engine keeps no weight_shape)
    gate_up = 2 * (w * H // 2 + w * H // 32 * 2)
    down = H * w // 2 + H * w // 32 * 2
    assert int4["routed experts"] == moe_layers * E * (gate_up + down)
    # FP8 (K2-Instruct): 1 byte per weight and a float32 scale per 128×128 tile of each slice
    tiles_h, tiles_w = H // 128, w // 128
    assert fp8["routed experts"] == moe_layers * E * (2 * w * H + 2 * tiles_w * tiles_h * 4 + H * w + tiles_h * tiles_w * 4)
    # the router stays float32 in the engine, replicated: [384, 7168] + bias [384] per MoE layer
    assert int4["router (float32)"] == moe_layers * (E * H + E) * 4
    # MLA latent cache: 61 layers × (512 + 64) bf16 per token, rows = 32768 tokens + one scratch block of 16
    assert int4["KV cache, target (MLA latent)"] == 61 * (32768 + 16) * 576 * 2
    # the drafter's K/V at TP1: 64 heads × 128 × (K, V) bf16 per token
    assert int4["KV cache, drafter (TP1)"] == (32768 + 16) * 64 * 128 * 2 * 2
    assert int4["embeddings"] == 163840 // N * H * 2


def test_sharded_drafter_splits_its_layer_and_cache(capsys, tmp_path):
    main(["plan", str(K25), "--drafter", str(DRAFTER), "--tp", "8", "--draft-tp", "8", "--gpu-memory-gib", "141", *LIMITS,
          "--json", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert "drafter sharded over the 8 GPUs" in out
    doc = read_json(tmp_path / "p.json")
    first, last = ({i["label"]: i["bytes"] for i in g["items"]} for g in (doc["gpus"][0], doc["gpus"][7]))
    assert first == last
    assert first["KV cache, drafter (shard)"] == (32768 + 16) * 8 * 128 * 2 * 2
    assert first["drafter embeddings"] == 163840 * 7168 * 2  # replicated


def _broken(tmp_path: Path, drop: str) -> Path:
    raw = read_json(K25 / "config.json")
    del raw["text_config"][drop]
    write_json(raw, tmp_path / "config.json")
    return tmp_path


@pytest.mark.parametrize("case, args, expect", [
    ("missing field", ["--tp", "8"], "text_config: field 'hidden_size' is missing"),
    ("unknown dtype", ["--tp", "8", "--dtype", "int8"], "dtype 'int8' is not supported (expected one of int4, fp8"),
    ("quantising", ["--tp", "8", "--dtype", "fp8"], "dtype 'fp8' keeps weights published in fp8"),
    ("tp", ["--tp", "3"], "num_attention_heads = 64 is not divisible by 3"),
    ("draft tp", ["--tp", "8", "--drafter", str(DRAFTER), "--draft-tp", "2"],
     "draft-tp = 2: expected 1 (drafter on GPU 0) or the target's tp 8"),
    ("draft tp, no drafter", ["--tp", "8", "--draft-tp", "8"], "--draft-tp 8: places a drafter; name it with --drafter"),
    ("ahead, no drafter", ["--tp", "8", "--draft-ahead"], "--draft-ahead: drafts ahead with a TP1 drafter only"),
    ("ahead, sharded", ["--tp", "8", "--drafter", str(DRAFTER), "--draft-tp", "8", "--draft-ahead"],
     "--draft-ahead: drafts ahead with a TP1 drafter only"),
    ("empty json", ["--tp", "8", "--json", ""], "--json '': expected a file path"),
    ("empty dtype", ["--tp", "8", "--dtype", ""], "dtype '' is not supported"),
    ("tiny budget", ["--tp", "8", "--gpu-memory-gib", "1e-12"], "--gpu-memory-gib = 0 (under a byte)"),
    ("long", ["--tp", "8", "--max-seq-len", "300000"], "max-seq-len = 300000 exceeds the target's max_position_embeddings"),
    ("negative k", ["--tp", "8", "--max-draft-len", "-1"], "max-draft-len = -1, expected an integer ≥ 0 (0: no speculation)"),
    ("k 0 with a drafter", ["--tp", "8", "--drafter", str(DRAFTER), "--max-draft-len", "0"],
     "max-draft-len = 0 with a drafter: expected at least 1"),
    ("huge k", ["--tp", "8", "--drafter", str(DRAFTER), "--max-draft-len", "100000"], "max-draft-len = 100000, expected an "
     "integer ≥ 0 (0: no speculation), at most 64"),
    ("too short to serve", ["--tp", "8", "--drafter", str(DRAFTER), "--max-seq-len", "5", "--max-draft-len", "3"],
     "max-seq-len = 5, expected ≥ 6 (a one-token prompt, one new token and the tokens a cycle verifies"),
])
def test_bad_input_is_one_line(capsys, tmp_path, case, args, expect):
    target = _broken(tmp_path, "hidden_size") if case == "missing field" else K25
    limits = [a for a in LIMITS] if "--max-seq-len" not in args else ["--max-batch-size", "1"]
    rc, out, err = plan(capsys, target, "--gpu-memory-gib", "141", *limits, *args)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and expect in err, err


def test_json_is_plain_json(capsys, tmp_path):
    main(["plan", str(FIXTURES / "kimi-k2-thinking"), "--tp", "8", "--gpu-memory-gib", "141", *LIMITS,
          "--json", str(tmp_path / "p.json")])
    capsys.readouterr()
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["weights"] == "int4" and doc["deployment"]["tp"] == 8 and doc["fits"] is True


def test_mla_drafter_planned_with_its_latent_cache_and_mla_layer(capsys, tmp_path):
    """The published MLA drafter for K2.5 (k-l-lambda/Kimi-K2.5-Eagle3): its KV cache is one latent row of
    kv_lora_rank + qk_rope_head_dim = 576 bf16 per token, not K and V per head; its layer bytes by hand."""
    mla = FIXTURES / "drafter-k-l-lambda-kimi-k2.5-eagle3-mla"
    rc, out, err = plan(capsys, K25, "--drafter", str(mla), "--tp", "8", "--gpu-memory-gib", "141", *LIMITS,
                        "--json", str(tmp_path / "plan.json"))
    assert rc == 0, err
    items = {i["label"]: i["bytes"] for i in read_json(tmp_path / "plan.json")["gpus"][0]["items"]}
    rows = next(v for k, v in items.items() if k.startswith("KV cache, target")) // (61 * 576 * 2)
    assert items["KV cache, drafter (TP1)"] == rows * 576 * 2
    H, TH, V = 7168, 7168, 163840
    layer = (H * 3 * TH                                          # fc
             + 2 * H * 1536 + 1536 * 64 * 192 + 2 * H * 576      # q_a, q_b, kv_a (2H inputs)
             + 64 * 128 * 512 * 2 + 64 * 128 * H                 # w_uk, w_uv (kv_b), o_proj
             + 3 * 18432 * H                                     # gate, up, down
             + 1536 + 512 + 4 * H)                               # q_a / kv_a norms, 4 hidden norms
    assert items["drafter layer (fc, attention, MLP)"] == layer * 2
    assert items["drafter lm_head + draft→target map"] == V * H * 2 + V * 8


def test_a_drafter_declaring_no_aux_convention_is_planned_as_one_that_declares_either(capsys, tmp_path):
    """The K2.5 MLA drafter's config names aux ids [2, 30, 58] but no convention (convert needs --aux-convention): plan
    takes it as it is, and its bytes are those of the same config declaring 'input' or 'output' (three aux states
    of the target's width whichever layers they come from), so plan has no --aux-convention."""
    mla = FIXTURES / "drafter-k-l-lambda-kimi-k2.5-eagle3-mla"
    assert "aux_layer_id_convention" not in read_json(mla / "config.json")["eagle_config"]
    docs = {}
    for convention in (None, "input", "output"):
        folder = mla
        if convention is not None:
            folder = tmp_path / convention
            folder.mkdir()
            cfg = read_json(mla / "config.json")
            cfg["eagle_config"]["aux_layer_id_convention"] = convention
            write_json(cfg, folder / "config.json")
        out = tmp_path / f"{convention}.json"
        rc, _, err = plan(capsys, K25, "--drafter", str(folder), "--tp", "8", "--gpu-memory-gib", "141", *LIMITS,
                          "--json", str(out))
        assert rc == 0, (convention, err)
        docs[convention] = read_json(out)
    assert docs[None] == docs["input"] == docs["output"]
    assert any(i["label"] == "drafter layer (fc, attention, MLP)" for i in docs[None]["gpus"][0]["items"])


@pytest.mark.parametrize("args, expect", [(["--headroom-gib", "nan"], "argument --headroom-gib: expected a number ≥ 0 and ≤ 1e+09, got 'nan'"),
                                          (["--gpu-memory-gib", "1e308"], "argument --gpu-memory-gib: expected a number > 0 and ≤ 1e+09")])
def test_non_finite_sizes_are_refused_by_the_parser(capsys, args, expect):
    """nan / inf / absurd GiB never reach the arithmetic: one line naming the argument, no usage block."""
    rc, out, err = plan(capsys, K25, "--tp", "8", "--gpu-memory-gib", "141", *LIMITS, *args)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and expect in err, err


def test_plan_reads_a_config_only_download_with_its_index(tmp_path, capsys):
    """A published folder with config.json and model.safetensors.index.json but no shard files (what
    tests/fixtures/published/make_index.py writes, or a download of the JSON files only) is planned from its config;
    one shard present of several is a partial download, refused naming the missing shard."""
    import shutil

    src = Path(__file__).parents[1] / "fixtures" / "published" / "kimi-k2.5"
    folder = tmp_path / "k25"
    folder.mkdir()
    shutil.copy(src / "config.json", folder / "config.json")
    write_json({"weight_map": {"language_model.model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                               "language_model.lm_head.weight": "model-00002-of-00002.safetensors"}},
               folder / "model.safetensors.index.json")
    args = ["plan", str(folder), "--tp", "8", "--gpu-memory-gib", "140", "--max-batch-size", "1", "--max-seq-len", "256"]
    assert main(args) == 0
    assert "(config only)" in capsys.readouterr().out
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert main(args) == 2
    assert "names shard 'model-00002-of-00002.safetensors', which is missing" in capsys.readouterr().err


def test_json_inside_an_input_folder_is_refused_before_anything_is_written(capsys, tmp_path):
    target = tmp_path / "k25"
    target.mkdir()
    (target / "config.json").write_text((K25 / "config.json").read_text())
    rc, out, err = plan(capsys, target, "--tp", "8", "--gpu-memory-gib", "141", *LIMITS, "--json", str(target / "config.json"))
    assert rc == 2 and out == "" and err.strip() == (f"splitspec plan: error: --json {target / 'config.json'}: inside the "
                                                     f"input folder {target}; write the plan elsewhere")
    assert (target / "config.json").read_text() == (K25 / "config.json").read_text()


def test_a_folder_splitspec_wrote_is_named_as_such(capsys, tmp_path):
    (tmp_path / "config.json").write_text((K25 / "config.json").read_text())
    write_json({"format": "splitspec-checkpoint"}, tmp_path / "engine.json")
    rc, out, err = plan(capsys, tmp_path, "--tp", "8", "--gpu-memory-gib", "141", *LIMITS)
    assert rc == 2 and err.strip() == (f"splitspec plan: error: {tmp_path}: a folder splitspec wrote (engine.json); plan "
                                       "the published checkpoint it came from")


def test_gpu0_activations_hold_the_sampled_decisions(capsys, demo_models):
    """The leader's sampled decisions filter at most SAMPLING_CHUNK logits at a time (SAMPLING_BYTES of temporaries):
    on the demo pair, whose eager forwards are smaller, GPU 0's activations are that floor and GPU 1's are not."""
    from splitspec.models.batch import SAMPLING_BYTES

    rc, out, err = plan(capsys, demo_models / "target", "--drafter", str(demo_models / "drafter"), "--tp", "2",
                        "--gpu-memory-gib", "80", "--max-batch-size", "4", "--max-seq-len", "512")
    assert rc == 0, err
    gpu0, gpu1 = row(out, "activations (eager peak)")
    assert gpu0 == pytest.approx(SAMPLING_BYTES / GIB, abs=0.006) and gpu1 < gpu0  # printed to 0.01 GiB
