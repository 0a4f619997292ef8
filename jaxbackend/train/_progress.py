"""Training progress on screen, through `rich`.

On a terminal: a live `rich.progress` bar (steps done of the total, loss,
tokens/s, time left). While it is drawn, rich redirects stdout and stderr
so that lines printed meanwhile (checkpoints, evaluations) appear above
the bar, each on a line of its own; its console does not wrap them
(`soft_wrap`), so long lines stay whole for copying.

Elsewhere (a log file, a pipe, a notebook, a test's captured output): a
plain line every ~5% of the run and at the end, so logs stay readable and
greppable. `quiet` shows nothing; the metrics log (`OUT/metrics.jsonl`)
is written either way (`metrics_log`).
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Callable

import rich.console
import rich.progress


class Progress:
    """Steps `start`..`total` on `stream` (default stderr): a bar while the
    context is entered and `stream` is a terminal, else plain lines."""

    def __init__(self, total: int, start: int = 0, quiet: bool = False, stream=None):
        self.total, self.start, self.quiet = total, start, quiet
        self.stream = stream or sys.stderr
        self.tty = not quiet and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = max(1, total // 20)
        self._bar: rich.progress.Progress | None = None

    def __enter__(self):
        if self.tty:
            self._bar = rich.progress.Progress(
                rich.progress.TextColumn("step"), rich.progress.MofNCompleteColumn(),
                rich.progress.BarColumn(), rich.progress.TextColumn("loss {task.fields[loss]}"),
                rich.progress.TextColumn("{task.fields[tok_s]} tok/s"),
                rich.progress.TimeRemainingColumn(),
                console=rich.console.Console(file=self.stream, soft_wrap=True))
            self._task = self._bar.add_task("train", total=self.total, completed=self.start,
                                            loss="-", tok_s="-")
            self._bar.start()
        return self

    def __exit__(self, *exc):  # an error or Ctrl-C mid-run still restores the screen
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def update(self, step: int, loss: float, tok_s: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{loss:.4f}",
                             tok_s=f"{tok_s / 1e3:.1f}k")
        elif not self.quiet and (step % self.every == 0 or step == self.total):
            print(f"step {step:>5}/{self.total}  loss {loss:.4f}  {tok_s / 1e3:.1f}k tok/s",
                  file=self.stream, flush=True)


def metrics_log(path: pathlib.Path, start: int) -> Callable:
    """`log(**fields)` appends one JSON line to `path`, OUT/metrics.jsonl (a
    notebook plots it with `pandas.read_json(path, lines=True)`). A run
    resumed at step `start` first drops the lines past it (a killed run
    logged steps it never saved), so the file tells the history of the
    weights on disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = []
    if start and path.exists():
        kept = [ln for ln in path.read_text().splitlines()
                if ln.strip() and json.loads(ln).get("step", 0) <= start]
    path.write_text("".join(ln + "\n" for ln in kept))

    def log(**fields) -> None:
        with path.open("a") as f:
            f.write(json.dumps(fields) + "\n")
    return log
