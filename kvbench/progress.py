"""Progress of long work, the one reporter every command uses: a bar on a terminal (tqdm), and on
anything else (a CI log, a pipe) a plain line every few seconds, never a flood of carriage returns.

A line reads ``desc: done/total unit (elapsed s, percent, rate, ETA, note)``, the parts a count
without a total cannot have left out: ``replaying: 3/228 runs (5 s, 1%, 0.60 runs/s, ETA 375 s)``,
``fuzz: 12 histories (5 s, 2.40 histories/s, 1 found)``."""
from __future__ import annotations

import sys
import time

LOG_EVERY_SECONDS = 5.0


class Progress:
    """``done`` of ``total`` ``unit``s of ``desc``; ``update(n)`` adds, ``set(done)`` sets,
    ``note(text)`` shows ``text`` beside the count. ``done``: work finished before this started
    (a resumed sweep), counted in the total but not in the rate. ``tty``: force a bar (True) or
    plain lines (False) instead of asking the stream. ``enabled=False`` prints nothing."""

    def __init__(self, total: int | None, desc: str, unit: str = "it", *, stream=None,
                 every: float = LOG_EVERY_SECONDS, done: int = 0, tty: bool | None = None,
                 enabled: bool = True):
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.stream = stream or sys.stderr
        self.done = self.initial = done
        self.enabled = enabled
        self.postfix = ""
        self.started = self.last = time.monotonic()
        self.bar = None
        tty = getattr(self.stream, "isatty", lambda: False)() if tty is None else tty
        if enabled and tty:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=done, desc=desc, unit=unit, leave=False,
                            file=self.stream, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.set(self.done + n)

    def set(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.done)
        self.done = done
        self.tick()

    def note(self, text: str) -> None:
        self.postfix = text
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)

    def tick(self) -> None:
        """A plain line if ``every`` seconds passed since the last one (a bar redraws itself)."""
        now = time.monotonic()
        if self.enabled and self.bar is None and now - self.last >= self.every:
            self.last = now
            self.say(self.line(now))

    def say(self, text: str) -> None:
        """One line of its own (what a command starts or finds), bar or not."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def line(self, now: float | None = None) -> str:
        elapsed = (now or time.monotonic()) - self.started
        rate = (self.done - self.initial) / elapsed if elapsed > 0 else 0.0
        parts = [f"{elapsed:.0f} s"]
        if self.total is not None:
            parts.append(f"{self.done / max(self.total, 1):.0%}")
        parts.append(f"{rate:.2f} {self.unit}/s")
        if self.total is not None:
            parts.append(f"ETA {(self.total - self.done) / rate:.0f} s" if rate > 0 else "ETA ?")
        if self.postfix:
            parts.append(self.postfix)
        of = f"/{self.total}" if self.total is not None else ""
        return f"{self.desc}: {self.done}{of} {self.unit} ({', '.join(parts)})"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class OutOfTime(BaseException):
    """A :class:`Deadline` passed: not an Exception, so no handler takes it for a failure."""


class Deadline:
    """A stand-in for a Progress that work reports each unit to (check()'s ``progress``): it
    raises OutOfTime, with the units done, once ``clock()`` passes ``at``."""

    def __init__(self, at: float, clock=time.monotonic):
        self.at, self.clock, self.done = at, clock, 0

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.clock() > self.at:
            raise OutOfTime(self.done)
