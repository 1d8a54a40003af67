"""Toy models with the corners a data-parallel wrapper must get right (a frozen parameter, a
bias that does not train, a weight used twice), and a GPT-style Transformer LM with presets."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


class ToyModel(nn.Module):
    """x -> fc1 -> ReLU -> (* frozen scale) -> fc2; ``fc2.bias`` does not train."""

    def __init__(self, in_features: int = 10, hidden: int = 16, out_features: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, out_features)
        self.fc2.bias.requires_grad_(False)
        self.frozen_scale = nn.Parameter(torch.linspace(0.5, 1.5, hidden), requires_grad=False)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)) * self.frozen_scale)


class TiedModel(nn.Module):
    """x -> fc_in -> ReLU -> shared -> ReLU -> shared (the same weight again) -> tanh -> fc_out."""

    def __init__(self, in_features: int = 10, hidden: int = 12, out_features: int = 5):
        super().__init__()
        self.fc_in = nn.Linear(in_features, hidden)
        self.shared = nn.Linear(hidden, hidden)
        self.fc_out = nn.Linear(hidden, out_features)

    def forward(self, x):
        h = F.relu(self.shared(F.relu(self.fc_in(x))))
        return self.fc_out(torch.tanh(self.shared(h)))


def random_regression_data(n: int, in_features: int = 10, out_features: int = 5, seed: int = 0):
    # n random (input, target) rows for the toy models, the same for a given seed
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, in_features, generator=g), torch.randn(n, out_features, generator=g)


# d_model, d_ff, layers, heads: GPT-2 small ... xl and 2.7B; "tiny" for tests, "course" between.
PRESETS = {
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
    with torch.device("meta"):  # no memory used
        return sum(p.numel() for p in TransformerLM(preset, context_length=context_length).parameters())


def causal_attention(q, k, v):  # softmax(q k^T / sqrt(d) + causal mask) v, [b, heads, t, d]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention; ``attend`` is an attribute so a lesson can swap it (ring attention)."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.attend = causal_attention

    def forward(self, x):
        b, t, d = x.shape
        # (b, t, d) -> (b, heads, t, d / heads)
        q, k, v = (z.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)
                   for z in self.qkv(x).split(d, dim=-1))
        return self.out(self.attend(q, k, v).transpose(1, 2).reshape(b, t, d))


def dense_mlp(d_model: int, d_ff: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))


class Block(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)); ``make_mlp(d_model, d_ff)`` builds the MLP."""

    def __init__(self, d_model: int, d_ff: int, num_heads: int, make_mlp=dense_mlp):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, num_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = make_mlp(d_model, d_ff)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    """Embeddings, pre-norm blocks, final norm, vocabulary head; ``checkpoint_activations``:
    backward recomputes each block from its input instead of keeping its activations."""

    def __init__(self, preset: str = "tiny", vocab_size: int = VOCAB_SIZE,
                 context_length: int = CONTEXT_LENGTH, checkpoint_activations: bool = False,
                 make_mlp=dense_mlp):
        super().__init__()
        p = PRESETS[preset]
        self.checkpoint_activations = checkpoint_activations
        self.token_embedding = nn.Embedding(vocab_size, p["d_model"])
        self.position_embedding = nn.Embedding(context_length, p["d_model"])
        self.blocks = nn.ModuleList(Block(p["d_model"], p["d_ff"], p["num_heads"], make_mlp)
                                    for _ in range(p["num_layers"]))
        self.norm = nn.LayerNorm(p["d_model"])
        self.lm_head = nn.Linear(p["d_model"], vocab_size, bias=False)
        for name, param in self.named_parameters():
            if param.dim() >= 2:  # GPT-2's init; residual projections scaled by depth
                residual = name.endswith(("out.weight", "mlp.2.weight"))
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * p["num_layers"]) if residual else 0.02)

    def forward(self, tokens, positions=None):
        """tokens [batch, seq] -> logits [batch, seq, vocab]; ``positions`` [seq] default 0..seq-1."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            if self.checkpoint_activations and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.norm(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def random_tokens(batch_size: int, context_length: int = CONTEXT_LENGTH, seed: int = 0,
                  device="cpu", vocab_size: int = VOCAB_SIZE):  # (inputs, targets) [batch, context]
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab_size, (batch_size, context_length + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]
