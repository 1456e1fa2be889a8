#!/usr/bin/env python3
"""Distinct routed experts per MoE layer while a random-weight target decodes a batch greedily, against the uniform
expectation E·(1 − (1 − k/E)^B) that :mod:`splitspec.measure.cost_model` charges (``distinct_experts``).

The full-depth benchmark (``bench/full_depth_rank.py``) decodes random-weight engines from prompts ``[1 + i] * 16``;
if such a model's tokens or hidden states collapsed with depth, the batch would route to fewer experts than the model
assumes and a deep engine would read fewer expert bytes. This checks that on the CPU: a target at reduced width
(hidden 256, float32) with Kimi-K2's routing (384 experts, top 8, one group), ``--layers`` deep, the same prompt form;
per decode step it prints the batch's distinct next tokens and the distinct experts per MoE layer (mean, min, max).

    PYTHONPATH=src python3 bench/lab/routing_spread.py --layers 61 --steps 6
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from splitspec.build.synthetic import kimi_k2_target
from splitspec.config import Mapping
from splitspec.measure.cost_model import distinct_experts
from splitspec.models import target
from splitspec.models.batch import padded
from splitspec.models.layers import TPComm
from splitspec.models.shapes import random_weights, target_shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6, help="decode steps after each prompt's prefill")
    a = ap.parse_args()
    base = kimi_k2_target(a.layers)
    cfg = dataclasses.replace(base, vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                              num_attention_heads=4, n_group=1, topk_group=1, q_lora_rank=128, kv_lora_rank=64,
                              qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope=dataclasses.replace(base.rope, dim=16))
    model = target.TargetModel(cfg, Mapping(1), 0, random_weights(target_shapes(cfg, Mapping(1)), torch.float32, "cpu", seed=0),
                               TPComm())
    chosen = []
    route = target.noaux_tc_route  # the CPU engine's routing; each MoE layer's expert ids recorded

    def recorded(x, gate, bias, c):
        weights, ids = route(x, gate, bias, c)
        chosen.append(ids)
        return weights, ids

    target.noaux_tc_route = recorded
    B, window, scratch = a.batch, 64, 4000
    cache = target.TargetKVCache(cfg, scratch + 1, torch.float32, "cpu")
    seqs = [[1 + i] * 16 for i in range(B)]
    blocks = [[2 * b, 2 * b + 1] for b in range(B)]  # two 16-row blocks a sequence: 32 positions
    for b in range(B):
        logits, _ = model.forward(padded([(blocks[b], 0, seqs[b])], window, "cpu", scratch_row=scratch), cache)
        seqs[b].append(int(logits[-1].argmax()))
    expect = distinct_experts(B, cfg.n_routed_experts, cfg.num_experts_per_tok)
    for step in range(a.steps):
        chosen.clear()
        batch = padded([(blocks[b], len(seqs[b]) - 1, [seqs[b][-1]]) for b in range(B)], window, "cpu", scratch_row=scratch)
        with torch.no_grad():
            logits, _ = model.forward(batch, cache)
        nxt = logits.argmax(-1).tolist()
        for b in range(B):
            seqs[b].append(nxt[b])
        distinct = [len(set(ids.flatten().tolist())) for ids in chosen]
        print(f"step {step}: {len(set(nxt))} distinct next tokens of {B}; distinct experts per MoE layer mean "
              f"{sum(distinct) / len(distinct):.1f}, min {min(distinct)}, max {max(distinct)} (uniform: {expect:.1f})", flush=True)


if __name__ == "__main__":
    main()
