"""Models and data shared by the stages: toy models with the corners a data-parallel wrapper
must get right (a frozen parameter, a bias that does not train, a weight used twice), and a
plain pre-norm GPT-style Transformer LM with size presets, the workload of the benchmarks."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


class ToyModel(nn.Module):
    """x -> fc1 -> ReLU -> (* frozen scale) -> fc2. ``fc2.bias`` requires no grad."""

    def __init__(self, in_features: int = 10, hidden: int = 16, out_features: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, out_features)
        self.fc2.bias.requires_grad_(False)  # a bias that does not train
        # A frozen parameter: part of the model's state, never updated.
        self.frozen_scale = nn.Parameter(torch.linspace(0.5, 1.5, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)) * self.frozen_scale)


class TiedModel(nn.Module):
    """x -> fc_in -> ReLU -> shared -> ReLU -> shared (the same weight again) -> tanh -> fc_out."""

    def __init__(self, in_features: int = 10, hidden: int = 12, out_features: int = 5):
        super().__init__()
        self.fc_in = nn.Linear(in_features, hidden)
        self.shared = nn.Linear(hidden, hidden)  # used twice per forward
        self.fc_out = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc_in(x))
        h = F.relu(self.shared(h))
        h = torch.tanh(self.shared(h))  # the same weight again
        return self.fc_out(h)


def random_regression_data(n: int, in_features: int = 10, out_features: int = 5,
                           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random (input, target) pairs for the toy models, the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, in_features, generator=g), torch.randn(n, out_features, generator=g)


# --------------------------------------------------------------------------- Transformer LM
# d_model / d_ff / layers / heads: GPT-2's small ... xl and a 2.7B configuration; "course" is
# the shape whose reference figures the READMEs quote; "tiny" is for tests.
PRESETS: dict[str, dict[str, int]] = {
    "tiny":   dict(d_model=64,   d_ff=256,   num_layers=2,  num_heads=4),
    "course": dict(d_model=512,  d_ff=1344,  num_layers=4,  num_heads=16),
    "small":  dict(d_model=768,  d_ff=3072,  num_layers=12, num_heads=12),
    "medium": dict(d_model=1024, d_ff=4096,  num_layers=24, num_heads=16),
    "large":  dict(d_model=1280, d_ff=5120,  num_layers=36, num_heads=20),
    "xl":     dict(d_model=1600, d_ff=6400,  num_layers=48, num_heads=25),
    "2.7B":   dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
}
VOCAB_SIZE = 10_000
CONTEXT_LENGTH = 256


def lm_parameter_count(preset: str, context_length: int = CONTEXT_LENGTH) -> int:
    """Parameters of ``TransformerLM(preset)``, built on the meta device: no memory used."""
    with torch.device("meta"):
        return sum(p.numel() for p in TransformerLM(preset, context_length=context_length)
                   .parameters())


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim) + causal mask) v, on [batch, heads, seq, head_dim]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention. ``attend(q, k, v)`` is the attention itself, an attribute so
    that a lesson can swap it (context parallelism puts ring attention there)."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()  # every preset's d_model divides by its num_heads
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.attend = causal_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # (b, t, d) -> (b, heads, t, d / heads)
        q, k, v = (z.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)
                   for z in (q, k, v))
        y = self.attend(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def dense_mlp(d_model: int, d_ff: int) -> nn.Module:
    """The block's MLP: d_model -> d_ff -> GELU -> d_model."""
    return nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(norm1(x)), then + mlp(norm2(x)). ``make_mlp(d_model,
    d_ff)`` builds the MLP (a mixture of experts, for example; default ``dense_mlp``)."""

    def __init__(self, d_model: int, d_ff: int, num_heads: int, make_mlp=dense_mlp):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, num_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = make_mlp(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    """Decoder-only LM: token + position embeddings, pre-norm blocks, final norm, vocab head.

    ``checkpoint_activations``: run each block under ``torch.utils.checkpoint`` (non-reentrant):
    backward keeps only each block's input and recomputes the block's forward to get the rest,
    trading one more forward of compute for most of the activation memory. ``make_mlp``: every
    block's MLP (see ``Block``).
    """

    def __init__(self, preset: str = "tiny", vocab_size: int = VOCAB_SIZE,
                 context_length: int = CONTEXT_LENGTH, checkpoint_activations: bool = False,
                 make_mlp=dense_mlp):
        super().__init__()
        if preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; choose from {', '.join(PRESETS)}")
        p = PRESETS[preset]
        self.checkpoint_activations = checkpoint_activations
        self.token_embedding = nn.Embedding(vocab_size, p["d_model"])
        self.position_embedding = nn.Embedding(context_length, p["d_model"])
        self.blocks = nn.ModuleList(Block(p["d_model"], p["d_ff"], p["num_heads"], make_mlp)
                                    for _ in range(p["num_layers"]))
        self.norm = nn.LayerNorm(p["d_model"])
        self.lm_head = nn.Linear(p["d_model"], vocab_size, bias=False)
        for name, param in self.named_parameters():
            if param.dim() >= 2:  # GPT-2 style init; residual projections scaled by depth
                residual = name.endswith(("out.weight", "mlp.2.weight"))
                std = 0.02 / math.sqrt(2 * p["num_layers"]) if residual else 0.02
                nn.init.normal_(param, std=std)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens`` [batch, seq] -> logits [batch, seq, vocab]. ``positions`` [seq]: each
        token's place in the whole sequence (default 0 .. seq-1; a rank holding a shard of the
        sequence passes its tokens' global positions)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            if self.checkpoint_activations and torch.is_grad_enabled():
                # looked up at call time, so a counter can wrap it (stage 07's ledger counts
                # the inputs a checkpoint keeps alive)
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.norm(x))  # logits: (batch, time, vocab)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def random_tokens(batch_size: int, context_length: int = CONTEXT_LENGTH, seed: int = 0,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (inputs, next-token targets), the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB_SIZE, (batch_size, context_length + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]
