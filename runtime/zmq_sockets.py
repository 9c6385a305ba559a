"""A ZeroMQ context and its sockets, released when their owner is, even if nobody calls close.

Why: ``zmq.Context.__del__`` closes the sockets it still tracks and then calls ``term()``,
which blocks until every socket of the context is closed. The context tracks its sockets
through weak references. When an owner that was never closed (a link left behind by an
error path, or by a test) is collected as part of a reference cycle together with its
context and sockets, CPython clears those weak references before any finalizer runs. The
context then sees no sockets to close, and its ``term()`` waits forever on sockets whose own
finalizers have not run yet. That hung a whole test run inside an unrelated test, wherever
the collector happened to run.

``release_on_collect(owner, ctx, *sockets)`` registers a ``weakref.finalize`` on the owner.
It holds the context and the sockets strongly, so they are never part of the owner's
garbage. The owner's death runs the callback before any finalizer of the cycle: it closes
the sockets (linger 0: nobody is left to flush for) and then terminates the context. The
returned finalizer is also the owner's close: after its own orderly shutdown (monitors off,
its own linger), the owner calls it, and it runs at most once.
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
