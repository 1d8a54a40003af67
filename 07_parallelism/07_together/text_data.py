"""Real text without a download: the Python standard library's own source, as bytes.

Tokens are bytes (vocabulary 256): no tokenizer. The standard library's files are split into
training and held-out text by a seeded shuffle of their names (the same split on every run
and rank); a file of your own is cut in two, its start for training, its end held out. The
two parts share nothing: a held-out loss on text the model trained on would say nothing.
Batch ``step`` is drawn from a generator seeded with (seed, step) alone: the same global
batch on every rank and for every grid, which is what makes every grid train the same model.

    train, held_out = load_text()          # or load_text("some_file.txt", max_bytes=10**6)
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
    skipped = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    return [path for path in sorted(root.rglob("*.py"))
            if not skipped & set(path.relative_to(root).parts)]


def load_text(data_file: str | None = None, max_bytes: int | None = None,
              held_out_share: float = 0.05, seed: int = 0) -> tuple[bytes, bytes]:
    """(training bytes, held-out bytes), together all the text read. ``data_file``: its first
    ``max_bytes``, cut at 1 - ``held_out_share``. Else the standard library's files shuffled
    by ``seed``, each wholly in one part, the training files read until ``max_bytes``."""
    if data_file is not None:
        return split_bytes(read_head(data_file, max_bytes), held_out_share)
    train_files, held_out_files = split_files(stdlib_files(), held_out_share, seed)
    held_out = b"".join(path.read_bytes() for path in held_out_files)
    train = bytearray()
    for path in train_files:
        if max_bytes is not None and len(train) >= max_bytes:
            break
        train += path.read_bytes()
    return bytes(train[:max_bytes]), held_out


def read_head(data_file: str, max_bytes: int | None = None) -> bytes:
    """The first ``max_bytes`` bytes of a file (all of it when None), read in pieces of 1 MiB:
    ``f.read(10**11)`` would set 100 GB aside before reading a byte."""
    pieces = []
    left = max_bytes if max_bytes is not None else math.inf
    with open(data_file, "rb") as f:
        while left > 0:
            piece = f.read(min(left, 2**20))
            if not piece:
                break
            pieces.append(piece)
            left -= len(piece)
    return b"".join(pieces)


def split_bytes(data: bytes, held_out_share: float = 0.05) -> tuple[bytes, bytes]:
    """One text cut in two at 1 - ``held_out_share``: (the start, the end)."""
    cut = int(len(data) * (1 - held_out_share))
    return data[:cut], data[cut:]


def split_files(files: list[Path], held_out_share: float = 0.05,
                seed: int = 0) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the files shuffled by ``seed``, the first
    ``held_out_share`` of them (at least one) held out, the rest for training."""
    shuffled = list(files)
    random.Random(seed).shuffle(shuffled)
    held_out_count = max(1, round(len(shuffled) * held_out_share))
    return shuffled[held_out_count:], shuffled[:held_out_count]


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
