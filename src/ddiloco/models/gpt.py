"""A small decoder-only transformer language model (nanoGPT-like), readable in one sitting.

Named sizes from ~0.1M to ~50M parameters live in ``GPT_CONFIGS``, dense and mixture-of-
experts (``moe-*``: top-2 routed expert MLPs, as the paper shows both). Parameter names follow one
pattern (``tok_emb``, ``pos_emb``, ``blocks.<i>.*``, ``ln_f``, ``head``) so layer-wise fragment
plans can group them by block. The output head is untied so embeddings can be flagged apart
(RDA merges them with the plain weighted mean).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddiloco.errors import require
from ddiloco.models.embeddings import embedding_names as embedding_names  # its old home


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int = 256  # byte-level by default
    block_size: int = 128  # context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    n_experts: int = 0  # 0: dense MLP; E > 0: a mixture of E expert MLPs per block
    top_k: int = 2  # experts each token is routed to
    aux_loss: float = 0.01  # weight of the load-balancing loss

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            require(value >= 1, f"model.{name}", value, "must be >= 1")
        require(
            self.n_embd % self.n_head == 0,
            "model.n_embd",
            self.n_embd,
            f"must be divisible by n_head={self.n_head}",
        )
        require(0.0 <= self.dropout < 1.0, "model.dropout", self.dropout, "must be in [0, 1)")
        require(self.n_experts >= 0, "model.n_experts", self.n_experts, "must be >= 0")
        if self.n_experts:
            require(
                1 <= self.top_k <= self.n_experts,
                "model.top_k",
                self.top_k,
                f"must be in [1, n_experts={self.n_experts}]",
            )


GPT_CONFIGS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64),  # ~0.1M
    "gpt-300k": GPTConfig(n_layer=3, n_head=3, n_embd=84, block_size=128),  # ~0.3M
    "gpt-1m": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),  # ~0.9M
    "gpt-4m": GPTConfig(n_layer=6, n_head=6, n_embd=240, block_size=256),  # ~4.3M
    "gpt-12m": GPTConfig(n_layer=8, n_head=8, n_embd=352, block_size=256),  # ~12M
    "gpt-50m": GPTConfig(n_layer=12, n_head=12, n_embd=576, block_size=512),  # ~48M
    "moe-tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, n_experts=4),  # ~0.3M
    "moe-4m": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, n_experts=8),  # ~4.5M
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return out


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.gelu(self.fc(x)))
        return out


class MoE(nn.Module):
    """Top-k routed expert MLPs (each token goes to k of E experts, weighted by the router's
    softmax), with the Switch-Transformer load-balancing loss kept in ``aux``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.router = nn.Linear(config.n_embd, config.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config) for _ in range(config.n_experts))
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        flat = x.reshape(-1, c)
        probs = F.softmax(self.router(flat), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        load = F.one_hot(chosen[:, 0], len(self.experts)).float().mean(0)
        self.aux = len(self.experts) * (load * probs.mean(0)).sum()
        return out.view(b, t, c)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp: nn.Module = MoE(config) if config.n_experts else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, final norm, linear head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean cross-entropy (nats/token) if targets given."""
        _, t = idx.shape
        require(t <= self.config.block_size, "sequence_length", t, "exceeds model.block_size")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        if self.config.n_experts and self.training:
            aux = sum(b.mlp.aux for b in self.blocks if isinstance(b.mlp, MoE))
            loss = loss + self.config.aux_loss * aux
        return logits, loss
