"""Rank 0's progress display on stderr: a redrawn bar on a terminal, periodic lines in logs.

Under ``horovodrun`` a rank's stderr is a pipe read line by line, so a carriage-return bar
would only appear when the epoch ends; ``lines`` mode prints a line per quarter epoch.
"""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    """``Progress(mode, epochs)``; ``update(...)`` each iteration, ``end_epoch()``."""

    def __init__(self, mode: str, epochs: int, stream: TextIO = sys.stderr):
        if mode == "auto":
            mode = "bar" if stream.isatty() else "lines"
        self.mode, self.epochs, self.stream = mode, epochs, stream
        self._last_line = -1

    def update(self, epoch: int, step: int, steps: int, loss: float, density: float) -> None:
        if self.mode == "none":
            return
        done = step + 1
        text = (f"epoch {epoch + 1}/{self.epochs} {done:>5}/{steps} loss {loss:.4f} "
                f"density {density:.4g}")
        if self.mode == "bar":
            filled = int(30 * done / max(steps, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {text}")
            self.stream.flush()
            return
        quarter = 4 * done // max(steps, 1)
        if quarter != self._last_line and (quarter > 0 or done == 1):
            self._last_line = quarter
            self.stream.write(f"{int(100 * done / max(steps, 1)):>3}% {text}\n")
            self.stream.flush()

    def end_epoch(self, message: str) -> None:
        if self.mode == "none":
            return
        if self.mode == "bar":
            self.stream.write("\n")
        self.stream.write(message + "\n")
        self.stream.flush()
        self._last_line = -1
