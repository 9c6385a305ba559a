"""A ZeroMQ context and its sockets, released when their owner is, even if nobody calls close.

Why: a context tracks its sockets by weak reference, and ``Context.__del__`` closes those
it still tracks, then ``term()`` blocks until every socket is closed. When an unclosed
owner is collected in a cycle with its context and sockets, CPython clears the weak
references first, so ``term()`` waits forever (it hung a whole test run).

``release_on_collect(owner, ctx, *sockets)`` registers a ``weakref.finalize`` on the owner
that holds them strongly: the owner's death closes the sockets (linger 0) and terminates
the context. The returned finalizer is also the owner's close; it runs at most once.
"""

from __future__ import annotations

import logging
import weakref

import zmq

log = logging.getLogger("runtime.zmq_sockets")


def _release(ctx: zmq.Context, sockets: tuple[zmq.Socket, ...]) -> None:
    for sock in sockets:
        if sock.closed:
            continue
        try:
            sock.close(linger=0)
        except Exception as e:  # an asyncio socket whose loop is gone: close the socket itself
            log.debug("closing %r through zmq.Socket: %r", sock, e)
            zmq.Socket.close(sock, linger=0)
    if not ctx.closed:
        ctx.term()


def release_on_collect(owner: object, ctx: zmq.Context, *sockets: zmq.Socket) -> weakref.finalize:
    """Closes ``sockets`` and terminates ``ctx`` when ``owner`` is collected or the returned
    finalizer is called, whichever comes first (once)."""
    return weakref.finalize(owner, _release, ctx, sockets)
