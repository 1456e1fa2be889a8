"""KV-cache space: a token budget carved into fixed-size blocks, shared by the target and drafter caches.

Every sequence owns a list of blocks; its token at position p lives in cache row
``blocks[p // block_size] * block_size + p % block_size`` of both the target's latent cache and the
drafter's K/V cache (paged attention, Kwon et al. 2023, arXiv:2309.06180, without preemption).
A sequence reserves, at admission, room for prompt + max_tokens + draft length + 1 tokens, so a running
sequence never runs out; rejected draft positions are simply overwritten by the next cycle.
"""

from __future__ import annotations

import torch

from splitspec.errors import ConfigError

BLOCK_SIZE = 16


def blocks_needed(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-tokens // block_size)


def slot_mapping(blocks: list[int], length: int, block_size: int = BLOCK_SIZE, device="cpu") -> torch.Tensor:
    """Cache rows of positions 0..length−1 of a sequence holding ``blocks``: [length] int64."""
    b = torch.tensor(blocks, dtype=torch.int64, device=device)
    rows = (b[:, None] * block_size + torch.arange(block_size, device=device)[None, :]).flatten()
    if rows.numel() < length:
        raise ConfigError(f"sequence of {length} tokens does not fit its {len(blocks)} blocks of {block_size}")
    return rows[:length]


class BlockAllocator:
    """Hands out KV blocks from a fixed pool of ``num_blocks`` (token budget / block size)."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = list(range(num_blocks - 1, -1, -1))

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)

    def can_allocate(self, tokens: int) -> bool:
        return blocks_needed(tokens, self.block_size) <= len(self.free)

    def allocate(self, tokens: int) -> list[int]:
        n = blocks_needed(tokens, self.block_size)
        if n > len(self.free):
            raise ConfigError(f"KV budget exhausted: {n} blocks needed, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))


def kv_blocks_for(limits: dict, kv_tokens: int | None) -> int:
    """KV blocks for a token budget (default: the engine's max_batch_size × max_seq_len)."""
    tokens = kv_tokens or limits.get("kv_tokens") or limits["max_batch_size"] * limits["max_seq_len"]
    if tokens < 1:
        raise ConfigError(f"kv_tokens = {tokens}, expected a positive token budget")
    return blocks_needed(int(tokens))
