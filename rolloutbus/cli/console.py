"""What every command does for the person at the terminal: one log format on stderr, the
libraries' own chatter kept out of it, progress bars only on a terminal, and SIGTERM
treated as Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import IO

from rolloutbus.kafka.repeated_lines import RepeatedLines

__all__ = [
    "LOG_FORMAT",
    "LOG_LEVEL_ENV",
    "QUIET_LIBRARIES",
    "setup_logging",
    "sigterm_as_ctrl_c",
    "graceful_stop_handler",
    "stop_on_signals",
]

# the log level of a command run without -v (e.g. WARNING: the demo's workers use it)
LOG_LEVEL_ENV = "ROLLOUTBUS_LOG_LEVEL"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries whose INFO lines describe their own machinery (Faust's and mode's start-up
# banners, aiokafka's joins and fetches, one httpx line per HTTP request, a health probe
# every few seconds): WARNING and above unless -v. librdkafka's logs come through the
# "librdkafka" logger (rolloutbus.kafka.clients gives every client it).
QUIET_LIBRARIES = ("faust", "mode", "aiokafka", "httpx", "httpcore", "librdkafka")
# Libraries that repeat a WARNING+ line per reconnect while a broker is away, held back to
# one per kind per 30 s (librdkafka's logger has its own filter: rolloutbus.kafka.clients)
REPEATING_LIBRARIES = ("aiokafka",)

SignalHandler = Callable[[int, FrameType | None], None]


def setup_logging(verbose: bool) -> None:
    """The one log format for every process the CLI starts (the demo's workers too).

    Level: DEBUG with -v, else ``$ROLLOUTBUS_LOG_LEVEL`` (INFO when unset or unknown).
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose else _level_from_env(),
        stream=sys.stderr,
        format=LOG_FORMAT,
    )
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)
    for handler in logging.getLogger().handlers:  # a broker outage: a line per kind per 30 s
        handler.addFilter(RepeatedLines(loggers=REPEATING_LIBRARIES))
    if not _is_terminal(sys.stderr):
        _no_progress_bars()


def _level_from_env() -> int:
    level = logging.getLevelName(os.environ.get(LOG_LEVEL_ENV, "INFO").strip().upper())
    return level if isinstance(level, int) else logging.INFO


def _is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _no_progress_bars() -> None:
    """tqdm bars redraw with ``\\r``: in a log file each redraw is a line of noise. tqdm
    reads ``TQDM_*`` variables as defaults when it is first imported (our own bars, and
    transformers' and huggingface_hub's), so this holds for the processes started from
    here too; huggingface_hub also has a switch of its own."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def sigterm_as_ctrl_c() -> None:
    """SIGTERM (what CI, ``timeout``, ``docker stop`` and systemd send) does what Ctrl-C
    does: raise KeyboardInterrupt, so every ``finally`` runs and a command that installs a
    handler of its own (train, dispatch, the workers) treats both alike. SIGINT is restored
    too: a non-interactive shell starts a background job (``cmd &``) with SIGINT ignored, and
    a user who sends it means it."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def stop_on_signals(stop: threading.Event, what: str, stream: IO[str] | None = None) -> None:
    """Ctrl-C or SIGTERM once: set ``stop`` and say so; the command finishes ``what`` and
    exits cleanly. A second one aborts at once (KeyboardInterrupt)."""
    handler = graceful_stop_handler(stop, what, stream)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def graceful_stop_handler(
    stop: threading.Event, what: str, stream: IO[str] | None = None
) -> SignalHandler:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            raise KeyboardInterrupt  # the second signal: abort now
        stop.set()
        out = stream if stream is not None else sys.stderr
        print(f"stopping after {what} (Ctrl-C again to abort)", file=out, flush=True)

    return on_signal
