"""A decoder-only transformer that Opacus ghost clipping can train, and a synthetic token language.

The model is built from nn.Embedding, nn.Linear and nn.LayerNorm only: ghost clipping
computes the per-sample gradient norms of Embedding and Linear layers without per-sample
gradients, and LayerNorm's from its per-sample gradients. Attention is written from
nn.Linear layers with a causal mask (not nn.MultiheadAttention), and the unembedding is
its own Linear layer (ghost clipping does not support tied parameters).

The language is a seeded random Markov chain: each token has a few likely successors, so a
model that learns the transitions brings the loss from log(vocab) towards their entropy.
"""

import torch
from torch import nn
from torch.nn import functional as F

# name: (vocabulary, width, layers, heads); about that many parameters at sequence length 64
SIZES = {
    "1M": (512, 128, 4, 4),
    "10M": (4096, 320, 6, 5),
    "25M": (6144, 512, 6, 8),
    "40M": (4096, 640, 7, 10),
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention from two Linear layers, each position seeing only earlier ones."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-norm transformer block: attention then a 4x MLP, each on a residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    """Token and position embeddings, transformer blocks, final LayerNorm, untied unembedding."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, max_len: int = 64):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.unembed = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        batch, length = idx.shape
        # positions as a (batch, length) input, as Opacus reads dimension 0 as the sample; both
        # inputs contiguous, as Opacus's embedding norms view them flat
        positions = torch.arange(length, device=idx.device).expand(batch, length).contiguous()
        x = self.tokens(idx.contiguous()) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.norm(x))


def build_model(size: str, seq_len: int = 64, seed: int = 0) -> TinyGPT:
    """A TinyGPT of the named size (see SIZES), its weights drawn from `seed`."""
    torch.manual_seed(seed)
    vocab, width, layers, heads = SIZES[size]
    return TinyGPT(vocab, width, layers, heads, max_len=seq_len)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def markov_tokens(vocab: int, n_sequences: int, seq_len: int, seed: int = 0, successors: int = 4) -> torch.Tensor:
    """(n_sequences, seq_len + 1) token ids from a random Markov chain of `successors` next tokens per token."""
    g = torch.Generator().manual_seed(seed)
    next_tokens = torch.randint(0, vocab, (vocab, successors), generator=g)
    weights = torch.rand(vocab, successors, generator=g)
    probs = weights / weights.sum(1, keepdim=True)
    tokens = torch.empty(n_sequences, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (n_sequences,), generator=g)
    for t in range(seq_len):
        choice = torch.multinomial(probs[tokens[:, t]], 1, generator=g).squeeze(1)
        tokens[:, t + 1] = next_tokens[tokens[:, t], choice]
    return tokens

