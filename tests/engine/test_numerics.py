"""Numerics against independent references: transformers' DeepseekV3 for the target, a plain-torch
EAGLE-3 forward built from transformers' Llama pieces for the drafter, and target-only decoding."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from splitspec.drafter_config import DrafterConfig
from splitspec.testing.reference import load_hf_reference_target
from splitspec.engine.group import Group
from splitspec.files import read_json
from splitspec.models.batch import ForwardBatch, single_blocks
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.settings import ServeConfig

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
# float32 everywhere; the engine computes MLA in absorbed form (q·W_UK against the latent) and
# transformers expands per-head K/V, so results agree to float32 rounding accumulated over 5 layers.
LOGITS_ATOL = 2e-4


@pytest.fixture(scope="module")
def prompt_ids(demo_models):
    return ChatTokenizer.from_dir(demo_models / "target").encode(PROMPT)


@pytest.fixture(scope="module")
def hf_target(demo_models):
    return load_hf_reference_target(demo_models / "target")


class TargetOnly:
    """Direct target forwards through rank 0 of a TP1 group, each sequence number in its own cache region."""

    def __init__(self, group):
        self.group, self.runner = group, group.rank0

    def forward(self, seqs, want, capture=()):
        batch = ForwardBatch.build([(single_blocks(s, 256), start, toks) for s, start, toks in seqs], want)
        return self.runner.target.forward(batch, self.runner.tcache, capture)


@pytest.fixture(scope="module")
def tp1_target(engines_for):
    group = Group(ServeConfig(engines_for(1)))
    yield TargetOnly(group)
    group.close()


def test_target_logits_match_transformers(tp1_target, hf_target, prompt_ids):
    with torch.inference_mode():
        ours, _ = tp1_target.forward([(0, 0, prompt_ids)], "all")
        ref = hf_target(torch.tensor([prompt_ids])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"target logits max |ours - transformers| = {diff:.3e} over {len(prompt_ids)} positions × {ref.shape[-1]} (logit std {ref.std():.2f})")
    assert ours.shape == ref.shape
    assert diff < LOGITS_ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_target_incremental_decode_matches_full_forward(tp1_target, hf_target, prompt_ids):
    """Prefill then one token at a time through the latent KV cache equals transformers' full forward."""
    split = len(prompt_ids) // 2
    with torch.inference_mode():
        first, _ = tp1_target.forward([(1, 0, prompt_ids[:split])], "all")
        rest = [tp1_target.forward([(1, p, [prompt_ids[p]])], "last")[0] for p in range(split, len(prompt_ids))]
        ref = hf_target(torch.tensor([prompt_ids])).logits[0].float()
    ours = torch.cat([first] + rest)
    assert (ours - ref).abs().max().item() < LOGITS_ATOL


@pytest.mark.parametrize("convention", ["input", "output"])
def test_aux_capture_matches_output_hidden_states(tp1_target, hf_target, prompt_ids, demo_models, convention):
    """The states captured for the drafter are exactly transformers' output_hidden_states entries
    (index i = input to layer i) named by the drafter's ids under its declared convention."""
    dcfg = DrafterConfig.from_hf(read_json(demo_models / "drafter" / "config.json") | {"eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [0, 2, 3]}}, aux_convention=convention)
    points = dcfg.capture_points()
    assert points == ((0, 2, 3) if convention == "input" else (1, 3, 4))
    with torch.inference_mode():
        _, aux = tp1_target.forward([(0, 0, prompt_ids)], "last", points)
        hs = hf_target(torch.tensor([prompt_ids]), output_hidden_states=True).hidden_states
    H = hf_target.config.hidden_size
    for j, i in enumerate(points):
        diff = (aux[:, j * H:(j + 1) * H] - hs[i][0]).abs().max().item()
        assert diff < LOGITS_ATOL, f"capture point {i}: max diff {diff}"
    # the neighbouring state is clearly different: an off-by-one would fail the check above
    assert (aux[:, 2 * H:] - hs[points[2] - 1][0]).abs().max().item() > 0.1


def test_target_greedy_matches_transformers_generate(engines_for, hf_target, prompt_ids):
    with SpeculativeEngine.load(ServeConfig(engines_for(1))) as eng:
        ours = eng.generate(prompt_ids, 16, num_draft_tokens=0, stop_token_ids=set()).token_ids
    with torch.inference_mode():
        ref = hf_target.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False)[0, len(prompt_ids):].tolist()
    assert ours == ref


def _reference_eagle3(weights: dict, cfg: DrafterConfig, embed: torch.Tensor, aux: torch.Tensor, tokens: torch.Tensor):
    """EAGLE-3 midlayer forward, full causal attention, no cache, from the published tensor names."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

    w = {k: v.float() for k, v in weights.items()}
    H, nq, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim

    def norm(x, name):
        n = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        n.weight.data = w[name]
        return n(x)

    g = aux @ w["fc.weight"].T
    a = torch.cat((norm(embed[tokens], "midlayer.input_layernorm.weight"), norm(g, "midlayer.hidden_norm.weight")), -1)
    T = a.shape[0]
    q = (a @ w["midlayer.self_attn.q_proj.weight"].T).view(T, nq, hd).transpose(0, 1)[None]
    k = (a @ w["midlayer.self_attn.k_proj.weight"].T).view(T, -1, hd).transpose(0, 1)[None]
    v = (a @ w["midlayer.self_attn.v_proj.weight"].T).view(T, -1, hd).transpose(0, 1)[None]
    rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=nq * hd, num_attention_heads=nq, head_dim=hd, rope_theta=cfg.rope.theta,
                                            max_position_embeddings=4096))
    cos, sin = rope(v, torch.arange(T)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1).reshape(T, -1)
    h = g + o @ w["midlayer.self_attn.o_proj.weight"].T
    x = norm(h, "midlayer.post_attention_layernorm.weight")
    mlp = (torch.nn.functional.silu(x @ w["midlayer.mlp.gate_proj.weight"].T) * (x @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
    h = h + mlp
    logits = norm(h, "norm.weight") @ w["lm_head.weight"].T
    return logits, h


def test_drafter_matches_reference_and_cache_is_consistent(engines_for, demo_models):
    """Drafter logits equal a from-scratch EAGLE-3 forward; extending in two chunks through the KV cache
    equals one chunk; draft ids map to target ids by d2t offsets."""
    group = Group(ServeConfig(engines_for(1)))
    drafter = group.rank0
    hf = load_file(str(demo_models / "drafter" / "model.safetensors"))
    embed = load_file(str(demo_models / "target" / "model-00001-of-00002.safetensors")).get("model.embed_tokens.weight")
    if embed is None:
        embed = load_file(str(demo_models / "target" / "model-00002-of-00002.safetensors"))["model.embed_tokens.weight"]
    g = torch.Generator().manual_seed(0)
    T = 12
    aux = torch.randn(T, 3 * drafter.drafter.cfg.target_hidden_size, generator=g)
    tokens = torch.randint(0, drafter.drafter.cfg.vocab_size, (T,), generator=g)
    m, cache = drafter.drafter, drafter.dcache
    group.close()
    ref_logits, ref_h = _reference_eagle3(hf, m.cfg, embed.float(), aux, tokens)
    b0, b1 = single_blocks(0, 256), single_blocks(1, 256)
    with torch.inference_mode():
        logits, h = m.forward(ForwardBatch.build([(b0, 0, tokens.tolist())], "all"), m.fuse(aux), cache)
        a, _ = m.forward(ForwardBatch.build([(b1, 0, tokens[:5].tolist())], "all"), m.fuse(aux[:5]), cache)
        b, _ = m.forward(ForwardBatch.build([(b1, 5, tokens[5:].tolist())], "all"), m.fuse(aux[5:]), cache)
    print(f"drafter logits max diff vs reference: {(logits - ref_logits).abs().max():.2e}")
    assert (logits - ref_logits).abs().max() < 1e-4
    assert (h - ref_h).abs().max() < 1e-4
    assert (torch.cat((a, b)) - logits).abs().max() < 1e-4
    d2t = hf["d2t"]
    ids = m.propose(logits)
    assert torch.equal(ids, logits.argmax(-1) + d2t[logits.argmax(-1)])
