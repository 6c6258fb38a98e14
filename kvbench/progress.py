"""Progress of long work: a bar on a terminal (tqdm), and on anything else (a CI log, a pipe) a plain
line every few seconds, never a flood of carriage returns."""
from __future__ import annotations

import sys
import time

LOG_EVERY_SECONDS = 5.0


class Progress:
    """``done`` of ``total`` ``unit``s of ``desc``; ``update(n)`` adds, ``set(done)`` sets."""

    def __init__(self, total: int | None, desc: str, unit: str = "it", *, stream=None,
                 every: float = LOG_EVERY_SECONDS):
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.stream = stream or sys.stderr
        self.done = 0
        self.postfix = ""  # what else to show beside the count (note())
        self.started = self.last = time.monotonic()
        self.bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=self.stream)

    def update(self, n: int = 1) -> None:
        self.set(self.done + n)

    def set(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.done)
            self.done = done
            return
        self.done = done
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self.stream.write(f"{self.line(now)}\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """Show ``text`` beside the count (rates, what was found so far)."""
        self.postfix = text
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)

    def line(self, now: float | None = None) -> str:
        of = f"/{self.total}" if self.total is not None else ""
        note = f", {self.postfix}" if self.postfix else ""
        return (f"{self.desc}: {self.done}{of} {self.unit} "
                f"({(now or time.monotonic()) - self.started:.0f} s{note})")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
