"""Real text without a download: the Python standard library's own source, as bytes.

Every machine that runs Python has megabytes of carefully written text on its disk: the
standard library. Tokens are bytes (vocabulary 256), so there is no tokenizer to train or
ship. The files are split into training and held-out text by a seeded shuffle of their names,
so the split is the same on every run and every rank.

The batches are what makes every grid train the same model: batch ``step`` is drawn from a
generator seeded with (seed, step) alone, the same global batch on every rank and for every
grid; each rank then takes its own part of it (its rows for data parallelism, its positions
for context and sequence parallelism).

    text = load_text()                     # or load_text("some_file.txt")
    train, held_out = split_text(text)
    x, y = batch_at(train, step=0, batch_size=8, seq_len=64)   # [8, 64] inputs, next bytes

Torch alone: copy this file anywhere.
"""

from __future__ import annotations

import math
import random
import sysconfig
from pathlib import Path

import torch

VOCAB_SIZE = 256  # one token per byte


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted, without installed packages and test suites."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        if "test" in parts or "tests" in parts or "idle_test" in parts:
            continue
        files.append(path)
    return files


def load_text(data_file: str | None = None, max_bytes: int | None = None,
              held_out_share: float = 0.05, seed: int = 0) -> tuple[bytes, bytes]:
    """(training bytes, held-out bytes).

    ``data_file``: any file, its first 1 - ``held_out_share`` for training and the rest held
    out. Without it, the standard library's source: its files shuffled by ``seed``, every
    file wholly in one of the two parts. ``max_bytes`` caps how much training text is read.
    """
    if data_file is not None:
        data = Path(data_file).read_bytes()
        cut = int(len(data) * (1 - held_out_share))
        return data[:cut][:max_bytes], data[cut:]
    files = stdlib_files()
    random.Random(seed).shuffle(files)
    held_out_count = max(1, round(len(files) * held_out_share))
    held_out = b"".join(path.read_bytes() for path in files[:held_out_count])
    train_parts = []
    train_bytes = 0
    for path in files[held_out_count:]:
        if max_bytes is not None and train_bytes >= max_bytes:
            break
        data = path.read_bytes()
        train_parts.append(data)
        train_bytes += len(data)
    train = b"".join(train_parts)
    return train[:max_bytes], held_out


def as_tokens(data: bytes) -> torch.Tensor:
    """Bytes -> a 1-D tensor of token ids 0..255."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch_at(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``batch_size`` windows of ``seq_len`` + 1 tokens at random
    places, the same for a given (seed, step) on every rank and every grid. Returns inputs and
    next-token targets, each [batch_size, seq_len]."""
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"the text has {len(tokens)} tokens, too few for windows of "
                         f"{seq_len + 1}; give more text or a shorter sequence")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([tokens[start:start + seq_len + 1] for start in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def unigram_loss(train: torch.Tensor, held_out: torch.Tensor) -> float:
    """The held-out loss (nats per byte) of the best model that ignores context: each byte
    predicted by its frequency in the training text (add-one smoothed, so that a byte unseen
    in training costs a finite amount). A language model has learnt something only below it."""
    counts = torch.bincount(train, minlength=VOCAB_SIZE).double() + 1.0
    log_probabilities = (counts / counts.sum()).log()
    return float(-log_probabilities[held_out].mean())


def perplexity(loss: float) -> float:
    return math.exp(loss)
