"""Start a response stream before the HTTP status is sent.

A streaming endpoint answers 200 as soon as it returns its ``StreamingResponse``; an error that
the engine raises afterwards (a prompt over the context length, an invalid parameter found at
tokenization) can then only travel as an event inside the stream. ``start_stream`` waits for the
stream's first item, so errors raised before it surface where the handler can still answer with
a 4xx, and returns an iterator that yields that first item followed by the rest.
"""

from __future__ import annotations

from typing import AsyncIterator, TypeVar

T = TypeVar("T")


async def start_stream(stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """Await the first item of ``stream``; return an iterator over all of its items.

    Raises:
        Whatever ``stream`` raises before its first item.
    """
    it = stream.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        return _yield_from((), it)
    return _yield_from((first,), it)


async def _yield_from(head: tuple, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    for item in head:
        yield item
    async for item in rest:
        yield item
