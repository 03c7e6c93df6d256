"""Waiting on a condition with a deadline: the tests' one way to synchronise with background work."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def wait_until(
    cond: Callable[[], bool | Awaitable[bool]], within: float = 20.0, what: str = "", *, every: float = 0.02
) -> None:
    """Poll ``cond`` (every ``every`` seconds) until it holds; fail after ``within`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        res = cond()
        if not isinstance(res, bool):
            res = await res
        if res:
            return
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(every)
