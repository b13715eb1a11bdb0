"""Fixtures of the assembly area: a replay buffer run in a thread of the test process."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import pytest

from rolloutbus.config import Config
from rolloutbus.streams.assembly.metrics import ReplayBufferMetrics
from rolloutbus.streams.assembly.replay_buffer import ReplayBuffer

THREAD_JOIN_S = 60.0  # seconds for the buffer's loop to end after stop()


@dataclass
class BufferThread:
    buffer: ReplayBuffer
    thread: threading.Thread

    def is_alive(self) -> bool:
        return self.thread.is_alive()


BufferRunner = Callable[..., AbstractContextManager[BufferThread]]


@pytest.fixture
def replay_buffer_thread() -> BufferRunner:
    """``with replay_buffer_thread(cfg[, metrics]) as running:`` a real ReplayBuffer runs in
    a thread until the block ends (``stop()``, then joined); an exception it raised fails
    the test there, on the test's thread."""

    @contextmanager
    def run(cfg: Config, metrics: ReplayBufferMetrics | None = None) -> Iterator[BufferThread]:
        buffer = ReplayBuffer(cfg) if metrics is None else ReplayBuffer(cfg, metrics=metrics)
        errors: list[BaseException] = []

        def loop() -> None:
            try:
                buffer.run()
            except BaseException as exc:  # reported on the test's thread below
                errors.append(exc)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield BufferThread(buffer, thread)
        finally:
            buffer.stop()
            thread.join(THREAD_JOIN_S)
        assert not errors, errors

    return run
