"""A small causal transformer language model over bytes (the ``python-text`` dataset).

Token and learned position embeddings, ``layers`` pre-LN blocks (causal multi-head
self-attention, then a 4x MLP with GELU, each with a residual), a final LayerNorm and an
untied linear head: logits ``(batch, context, vocab)`` for inputs ``(batch, context)`` of
token ids. No dropout, no BatchNorm and no in-place operations, so per-worker gradients can
be taken with ``torch.func.vmap(grad(...))`` over ``functional_call``. Attention is written
with plain tensor operations (a boolean causal mask), which vmap batches on every backend.

``text_transformer()`` (vocabulary 256, context 64, width 64, 4 heads, 2 blocks) has
137,216 parameters. (``F.scaled_dot_product_attention`` has no vmap batching rule for
its CPU kernels in torch 2.x: vmap falls back to a loop over the workers, measured at half
the speed at width 128.)
"""

from __future__ import annotations

import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.reshape(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-2, -1) * (width // self.heads) ** -0.5
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TextTransformer(nn.Module):
    """Causal language model: token ids ``(batch, length <= context)`` -> logits
    ``(batch, length, vocab)``."""

    def __init__(self, vocab: int = 256, context: int = 64, width: int = 64, heads: int = 4,
                 layers: int = 2):
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[-1]
        if length > self.context:
            raise ValueError(f"sequence of {length} tokens exceeds the context {self.context}")
        positions = torch.arange(length, device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        return self.head(self.ln(self.blocks(x)))


def text_transformer(num_classes: int = 256, context: int = 64) -> TextTransformer:
    """The ``python-text`` language model: ``num_classes`` is the vocabulary (256 bytes)."""
    return TextTransformer(vocab=num_classes, context=context)
