"""The GPT-style model the benchmarks train (decoder-only, pre-norm, causal attention)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class ModelSize:
    vocab: int
    d_model: int
    layers: int
    heads: int
    block: int  # tokens of context
    batch: int  # sequences per step


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer: token and position embeddings, pre-norm causal blocks, an untied head."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(size.vocab, size.d_model), nn.Embedding(size.block, size.d_model)
        self.blocks = nn.ModuleList(Block(size.d_model, size.heads) for _ in range(size.layers))
        self.norm, self.head = nn.LayerNorm(size.d_model), nn.Linear(size.d_model, size.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
