"""What packages and services share about how they load and run: names a package re-exports
on first use (so importing a light room does not load torch or httpx), and a service served
until SIGTERM or SIGINT, or in a background thread for synchronous callers. Imports nothing
of the package."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``where[name]`` (a module path)
    on first use of ``name``."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__


class Service(Protocol):
    @property
    def url(self) -> str: ...

    async def stop(self) -> None: ...


S = TypeVar("S", bound=Service)


async def serve_until_signalled(
    what: str, start: Callable[[], Awaitable[S]], on_ready: Callable[[S], None]
) -> None:
    """Start a service, call ``on_ready`` with it, and stop it at SIGTERM or SIGINT (the
    handlers are set before the start, so a signal during a slow start still stops it)."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    service = await start()
    on_ready(service)
    try:
        await stopping.wait()
    finally:
        log.info("%s on %s stopping", what, service.url)
        await service.stop()


@contextlib.contextmanager
def serve_in_thread(thread_name: str, start: Callable[[], Coroutine[Any, Any, S]]) -> Iterator[S]:
    """A service started by ``start`` on its own event loop in a daemon thread named
    ``thread_name``, for synchronous callers (tests, scripts); stopped, and the loop closed,
    when the block ends."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=thread_name, daemon=True)
    thread.start()
    try:
        service = asyncio.run_coroutine_threadsafe(start(), loop).result()
        try:
            yield service
        finally:
            asyncio.run_coroutine_threadsafe(service.stop(), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
