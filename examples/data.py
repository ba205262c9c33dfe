"""A real-text data path for the examples: a bundled corpus, a character tokenizer, and a loader
that feeds each process its rows of every global batch, with a held-out split for eval loss.

``examples/data/corpus.txt`` is the prose of shardplan's own README and docs (code blocks and
tables removed, about 42 KB), bundled so nothing downloads at run time. Any UTF-8 text file
works. Tokens are characters of a fixed 61-symbol alphabet (lower-cased; anything else maps to
'?'), so every example model (vocab >= 64) can read them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ALPHABET = "\n !\"#'()*+,-./:;<=>?[]_`|0123456789abcdefghijklmnopqrstuvwxyz"
UNKNOWN = ALPHABET.index("?")
CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
_TABLE = np.full(0x110000, UNKNOWN, np.int32)
_TABLE[[ord(c) for c in ALPHABET]] = np.arange(len(ALPHABET), dtype=np.int32)


def tokenize(text: str) -> np.ndarray:
    """Characters -> token ids in [0, len(ALPHABET))."""
    codes = np.frombuffer(text.lower().encode("utf-32-le"), dtype=np.uint32)
    return _TABLE[codes]


def detokenize(tokens) -> str:
    return "".join(ALPHABET[int(t)] if 0 <= int(t) < len(ALPHABET) else "?" for t in tokens)


class TextData:
    """Windows of ``seq_len + 1`` tokens from a text file: the first 90% trains, the rest evaluates.

    ``next_batch()`` draws a global batch of random training windows (every process draws the
    same, then keeps its ``rows``), ``eval_batches(n)`` gives fixed held-out windows.
    """

    def __init__(self, path: str | Path, seq_len: int, batch: int, seed: int = 0, rows: slice | None = None,
                 eval_fraction: float = 0.1):
        text = Path(path).read_text(encoding="utf-8")
        tokens = tokenize(text)
        cut = int(len(tokens) * (1 - eval_fraction))
        self.train, self.eval = tokens[:cut], tokens[cut:]
        if min(len(self.train), len(self.eval)) <= seq_len + 1:
            raise ValueError(f"{path}: {len(tokens)} tokens is too little text for windows of {seq_len + 1}")
        self.seq_len, self.batch, self.rows = seq_len, batch, rows
        self.rng = np.random.default_rng(seed)

    def _windows(self, source: np.ndarray, starts: np.ndarray) -> dict:
        seqs = np.stack([source[s: s + self.seq_len + 1] for s in starts])
        seqs = seqs[self.rows] if self.rows is not None else seqs
        return {"tokens": seqs[:, :-1].astype(np.int32), "labels": seqs[:, 1:].astype(np.int32)}

    def next_batch(self) -> dict:
        return self._windows(self.train, self.rng.integers(0, len(self.train) - self.seq_len - 1, size=self.batch))

    def eval_batches(self, n: int) -> list[dict]:
        step = max((len(self.eval) - self.seq_len - 1) // (n * self.batch), 1)
        starts = np.arange(n * self.batch) * step % (len(self.eval) - self.seq_len - 1)
        return [self._windows(self.eval, starts[i * self.batch: (i + 1) * self.batch]) for i in range(n)]
