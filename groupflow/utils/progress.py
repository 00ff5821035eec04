"""Progress of long commands: a bar on a terminal, a periodic log line anywhere else.

Design decision: eval, generate, convert-gguf, pretrain-diffusion and the validation inside train
report through this one class. On a terminal (the stream is a tty) it draws a tqdm bar — done /
total, tokens/s and running accuracy in the postfix — which a heartbeat thread redraws every
second, so the elapsed time moves even while one long chunk runs (64 prompts of a real model take
minutes on a CPU, and the work cannot report from inside the decode loop of a worker). Anywhere
else (a log file, CI, nohup) a bar would write one line per redraw, so it logs one line with the
same numbers at most every ``interval_s`` seconds instead — from the heartbeat too, so a long
silent stage still says it is alive — and a last line when a task that logged anything ends.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["INTERVAL_S", "Progress"]

log = logging.getLogger("groupflow")
# Seconds between two log lines off a terminal (read when a Progress starts).
INTERVAL_S = 30.0


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class Progress:
    """``with Progress("eval (greedy)", total=100) as p: ... p.update(8, tokens=900, correct=3,
    scored=8)``. ``stream`` (default stderr) decides between the bar and log lines; ``stage``
    names the current step of a task without a natural count (convert-gguf)."""

    def __init__(
        self,
        desc: str,
        total: int | None,
        unit: str = "prompts",
        *,
        stream: TextIO | None = None,
        leave: bool = True,
        interval_s: float | None = None,
        heartbeat_s: float | None = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.done = self.tokens = self.correct = self.scored = 0
        self.extra: dict[str, Any] = {}
        self._stage = ""
        self._stream = stream if stream is not None else sys.stderr
        self._interval = INTERVAL_S if interval_s is None else interval_s
        self._clock = clock
        self._start = self._last_line = clock()
        self._lines = 0
        self._lock = threading.Lock()
        self._bar = None
        isatty = getattr(self._stream, "isatty", None)
        if callable(isatty) and isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total, desc=desc, unit=f" {unit}", file=self._stream, leave=leave,
                dynamic_ncols=True,
            )  # fmt: skip
        self._stop = threading.Event()
        self._thread = None
        if heartbeat_s:
            self._thread = threading.Thread(
                target=self._heartbeat, args=(heartbeat_s,), name="groupflow-progress", daemon=True
            )
            self._thread.start()

    # ----- what is shown ---------------------------------------------------------------------------
    def _postfix(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self._stage:
            out["stage"] = self._stage
        elapsed = max(self._clock() - self._start, 1e-9)
        if self.tokens:
            out["tokens/s"] = f"{self.tokens / elapsed:,.0f}"
        if self.scored:
            out["acc"] = f"{self.correct / self.scored:.1%}"
        out.update({k: str(v) for k, v in self.extra.items()})
        return out

    def line(self) -> str:
        """The log line: ``eval (greedy): 64/100 prompts, 1,234 tokens/s, acc 45.3%, 2 min 03 s``."""
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        parts = [f"{count} {self.unit}"]
        parts += [f"{v} {k}" if k == "tokens/s" else f"{k} {v}" for k, v in self._postfix().items()]
        parts.append(_duration(self._clock() - self._start))
        return f"{self.desc}: {', '.join(parts)}"

    def _emit(self, force: bool = False) -> None:
        now = self._clock()
        if force or now - self._last_line >= self._interval:
            self._last_line = now
            self._lines += 1
            log.info("%s", self.line())

    # ----- updates ---------------------------------------------------------------------------------
    def update(
        self, n: int = 1, *, tokens: int = 0, correct: int = 0, scored: int = 0, **extra: Any
    ) -> None:
        """``n`` more items done; ``tokens`` generated, ``correct`` of ``scored`` samples right;
        ``extra`` values (e.g. ``loss="0.123"``) are shown as they are."""
        with self._lock:
            self.done += n
            self.tokens += tokens
            self.correct += correct
            self.scored += scored
            self.extra.update(extra)
            if self._bar is not None:
                self._bar.set_postfix(self._postfix(), refresh=False)
                self._bar.update(n)
            else:
                self._emit()

    def stage(self, text: str, advance: int = 0) -> None:
        """Name what is running now (shown until the next stage), ``advance`` items being done."""
        with self._lock:
            self._stage = text
            self.done += advance
            if self._bar is not None:
                self._bar.set_postfix(self._postfix(), refresh=False)
                self._bar.update(advance) if advance else self._bar.refresh()
            else:
                self._emit()

    def write(self, text: str, file: TextIO) -> None:
        """Print a line of output (e.g. to stdout) without tearing a bar on the same terminal."""
        with self._lock:
            if self._bar is not None:
                self._bar.write(text, file=file)
            else:
                print(text, file=file, flush=True)

    def _heartbeat(self, every: float) -> None:
        while not self._stop.wait(every):
            with self._lock:
                if self._bar is not None:
                    self._bar.set_postfix(self._postfix(), refresh=False)
                    self._bar.refresh()
                else:
                    self._emit()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
            elif self._lines or self._clock() - self._start >= self._interval:
                self._emit(force=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
