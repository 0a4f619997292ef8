"""Loss-curve PNG: per-step training loss (raw and smoothed), validation
points and the unigram baseline. Uses matplotlib's Agg backend, so it works
on headless machines and never opens a window."""

from __future__ import annotations

import pathlib

import numpy as np


def smooth(values, window: int = 20) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return v
    w = max(1, min(window, len(v) // 5 or 1))
    c = np.cumsum(np.insert(v, 0, 0.0))
    head = c[1:w] / np.arange(1, w)
    return np.concatenate([head, (c[w:] - c[:-w]) / w])


def loss_curve(path, history, val_history, baseline=None, ax=None) -> pathlib.Path | None:
    """Draw the curves; writes `path` (PNG) unless an `ax` is given (notebooks)."""
    import matplotlib
    if ax is None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = np.arange(1, len(history) + 1)
    ax.plot(steps, history, color="tab:blue", alpha=0.3, lw=0.8, label="train (per step)")
    ax.plot(steps, smooth(history), color="tab:blue", lw=1.8, label="train (smoothed)")
    if val_history:
        vs, vl = zip(*val_history)
        ax.plot(vs, vl, "o-", color="tab:orange", label="validation")
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", label=f"unigram baseline {baseline:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/char)")
    ax.set_title("char-level GPT on the Python stdlib source")
    ax.legend()
    if fig is None:
        return None
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
