"""Connections cannot be held hostage: a real gateway (HTTP on aiohttp) with shortened
timeouts, driven over raw loopback sockets. Waits are for conditions with generous
deadlines; nothing asserts how fast the machine is."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from gateway.config import ConfigError, GatewayConfig, default_body_limit
from gateway.edge import http_edge
from gateway.rpc.server import _server_options

from .harness import FakeScheduler, fake_scheduler, gateway, run

GENEROUS_S = 20.0


@contextlib.asynccontextmanager
async def _http_gateway(tokenizer, **config):
    async with fake_scheduler(FakeScheduler()) as address, \
            gateway(tokenizer, address, http_port=0, **config) as (running, _):
        yield running.http_port


async def _read_until_closed(reader: asyncio.StreamReader) -> bytes:
    data = b""
    while chunk := await reader.read(65536):
        data += chunk
    return data


def test_a_body_shorter_than_its_content_length_gets_408_and_a_closed_connection(tokenizer):
    async def scenario():
        async with _http_gateway(tokenizer, http_body_timeout_s=0.5,
                                 http_lingering_s=0.5) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"prompt":')
            await writer.drain()
            answer = await asyncio.wait_for(_read_until_closed(reader), GENEROUS_S)
            writer.close()
            return answer

    answer = run(scenario())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:200]
    error = json.loads(body)["error"]
    assert "did not arrive within 0.5 s" in error["message"]
    # _read_until_closed returned: the server closed the connection itself.


def test_a_request_head_that_trickles_in_is_cut(tokenizer):
    """Slowloris: one header byte at a time, never finishing the head."""
    async def scenario():
        async with _http_gateway(tokenizer, http_header_timeout_s=0.5) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            closed = asyncio.ensure_future(_read_until_closed(reader))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + GENEROUS_S
            sent = 0
            while not closed.done() and loop.time() < deadline:
                with contextlib.suppress(ConnectionError):
                    writer.write(b"a")
                    await writer.drain()
                    sent += 1
                await asyncio.sleep(0.05)
            writer.close()
            return closed.done(), sent

    closed, sent = run(scenario(), timeout_s=GENEROUS_S + 10)
    assert closed, "the server kept a never-finished request head open"
    assert sent > 0


async def _get_live(port: int, source: str = "127.0.0.1") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(b"GET /live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answer = await asyncio.wait_for(_read_until_closed(reader), GENEROUS_S)
    writer.close()
    return answer


async def _busy(port: int):
    """A connection with a request in progress: its body is still arriving."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    await writer.drain()
    return reader, writer


async def _answered_then_idle(port: int):
    """A keep-alive connection that has had one answer and now waits."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), GENEROUS_S)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    return reader, writer


@pytest.fixture
def quick_idle(monkeypatch):
    monkeypatch.setattr(http_edge, "IDLE_BEFORE_REUSE_S", 0.2)


def test_a_full_cap_of_idle_connections_gives_way_to_a_new_one(tokenizer, quick_idle):
    """The cap is full of keep-alive connections that were answered and sit idle: the
    one idle longest is closed, and the newcomer is served."""
    async def scenario():
        async with _http_gateway(tokenizer, http_max_connections=3,
                                 http_max_connections_per_client=10) as port:
            held = [await _answered_then_idle(port) for _ in range(3)]
            await asyncio.sleep(0.3)  # idle past IDLE_BEFORE_REUSE_S
            served = await _get_live(port)
            oldest = await asyncio.wait_for(_read_until_closed(held[0][0]), GENEROUS_S)
            for _, writer in held:
                writer.close()
            return served, oldest

    served, oldest = run(scenario(), timeout_s=GENEROUS_S + 10)
    assert served.startswith(b"HTTP/1.1 200"), served[:200]
    assert oldest == b""  # closed between requests: nothing was owed to it


def test_connections_that_have_not_asked_yet_are_never_closed_to_make_room(tokenizer,
                                                                          quick_idle):
    """A full cap of connections that sent nothing yet: their requests may be on the wire,
    so the newcomer is answered 503 instead; once the header timeout closes the silent
    ones, a newcomer is served."""
    async def scenario():
        async with _http_gateway(tokenizer, http_max_connections=3, http_header_timeout_s=1.0,
                                 http_max_connections_per_client=10) as port:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            await asyncio.sleep(0.3)
            refused = await _get_live(port)
            closed = [await asyncio.wait_for(_read_until_closed(r), GENEROUS_S)
                      for r, _ in held]
            served = await _get_live(port)
            for _, writer in held:
                writer.close()
            return refused, closed, served

    refused, closed, served = run(scenario(), timeout_s=GENEROUS_S + 10)
    assert refused.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in refused, refused[:200]
    assert closed == [b""] * 3  # closed by the header timeout, never having asked
    assert served.startswith(b"HTTP/1.1 200"), served[:200]


def test_a_burst_from_one_address_past_its_cap_is_answered_every_time(tokenizer):
    """Many connections at once from one client, then each one's request (some with a
    body): those within the client's cap are served, the rest answered 429 with
    Retry-After; not one is closed without an HTTP answer."""
    get = b"GET /live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    body = json.dumps({"prompt": "hello " * 500}).encode()
    post = (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body)

    async def ask(connection, request: bytes) -> bytes:
        reader, writer = connection
        try:
            writer.write(request)
            await writer.drain()
            return await asyncio.wait_for(_read_until_closed(reader), GENEROUS_S)
        except ConnectionError as exc:
            return repr(exc).encode()
        finally:
            writer.close()

    async def scenario():
        async with _http_gateway(tokenizer, http_max_connections_per_client=4) as port:
            # All connected (and accepted) before any request is sent: the gateway sees
            # every one waiting for its first request, as in a burst from another host.
            connections = [await asyncio.open_connection("127.0.0.1", port)
                           for _ in range(60)]
            await asyncio.sleep(0.3)
            return await asyncio.gather(*(ask(c, post if i % 2 else get)
                                          for i, c in enumerate(connections)))

    answers = run(scenario(), timeout_s=GENEROUS_S + 10)
    statuses = [answer[:12] for answer in answers]
    assert all(s in (b"HTTP/1.1 200", b"HTTP/1.1 429") for s in statuses), statuses
    assert statuses.count(b"HTTP/1.1 429") > 0 and statuses.count(b"HTTP/1.1 200") >= 2
    refused = next(a for a in answers if a.startswith(b"HTTP/1.1 429"))
    head, _, error = refused.partition(b"\r\n\r\n")
    assert b"Retry-After: 1" in head
    assert "--http-max-connections-per-client" in json.loads(error)["error"]["message"]


def test_connections_past_the_cap_all_busy_get_503_and_the_cap_frees_up(tokenizer):
    async def scenario():
        async with _http_gateway(tokenizer, http_max_connections=2,
                                 http_body_timeout_s=GENEROUS_S) as port:
            held = [await _busy(port) for _ in range(2)]
            await asyncio.sleep(0.2)  # both requests in progress before the third
            refused = await _get_live(port)
            for _, held_writer in held:
                held_writer.close()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + GENEROUS_S
            while loop.time() < deadline:  # once the held ones are gone, served again
                answer = await _get_live(port)
                if answer.startswith(b"HTTP/1.1 200"):
                    return refused, answer
                await asyncio.sleep(0.1)
            return refused, b""

    refused, served = run(scenario(), timeout_s=2 * GENEROUS_S + 10)
    head, _, body = refused.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), refused[:200]
    assert "limit of 2 open connections, all busy" in json.loads(body)["error"]["message"]
    assert served.startswith(b"HTTP/1.1 200")


def test_a_client_at_its_cap_gives_up_its_own_idle_connection_then_gets_429(tokenizer,
                                                                           quick_idle):
    """Its idle sockets do not lock the client itself out: one more connection closes its
    longest-idle one. With all of them busy, one more is 429; another address is served."""
    async def scenario():
        async with _http_gateway(tokenizer, http_max_connections_per_client=2,
                                 http_body_timeout_s=GENEROUS_S) as port:
            idle = [await _answered_then_idle(port) for _ in range(2)]
            await asyncio.sleep(0.3)
            served_over_idle = await _get_live(port)
            oldest = await asyncio.wait_for(_read_until_closed(idle[0][0]), GENEROUS_S)
            for _, writer in idle:
                writer.close()
            await asyncio.sleep(0.2)
            busy = [await _busy(port) for _ in range(2)]
            await asyncio.sleep(0.2)
            refused = await _get_live(port)
            other = await _get_live(port, source="127.0.0.2")  # another client address
            for _, writer in busy:
                writer.close()
            await asyncio.sleep(0.2)
            return served_over_idle, oldest, refused, other, await _get_live(port)

    served_over_idle, oldest, refused, other, served = run(scenario(),
                                                           timeout_s=GENEROUS_S + 10)
    assert served_over_idle.startswith(b"HTTP/1.1 200") and oldest == b""
    head, _, body = refused.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429") and b"Retry-After: 1" in head, refused[:200]
    assert "--http-max-connections-per-client" in json.loads(body)["error"]["message"]
    assert other.startswith(b"HTTP/1.1 200") and served.startswith(b"HTTP/1.1 200")


def test_grpc_server_options_bound_streams_and_idle_connections(tmp_path):
    config = GatewayConfig(model_dir=tmp_path, scheduler_address="127.0.0.1:1",
                           grpc_max_concurrent_streams=100, grpc_max_connection_idle_s=300)
    options = dict(_server_options(config, config.body_limit(8192)))
    assert options["grpc.max_concurrent_streams"] == 100
    assert options["grpc.max_connection_idle_ms"] == 300_000
    assert options["grpc.max_receive_message_length"] == 1 << 20


def test_the_default_body_limit_follows_the_context_and_a_flag_overrides_it(tmp_path):
    assert [default_body_limit(n) for n in (512, 8192, 32768, 131072, 131073)] == [
        1 << 20, 1 << 20, 1 << 20, 4 << 20, 5 << 20]
    config = GatewayConfig(model_dir=tmp_path, scheduler_address="127.0.0.1:1")
    assert config.body_limit(131072) == 4 << 20
    pinned = GatewayConfig(model_dir=tmp_path, scheduler_address="127.0.0.1:1",
                           max_body_bytes=4096)
    assert pinned.body_limit(131072) == 4096
    with pytest.raises(ConfigError, match="--max-body-bytes"):
        GatewayConfig(model_dir=tmp_path, scheduler_address="127.0.0.1:1", max_body_bytes=10)


def test_an_idle_keep_alive_connection_outlives_the_header_timeout(tokenizer):
    """The head timer runs only while a head is arriving, not between requests."""
    request = b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n"

    async def scenario():
        async with _http_gateway(tokenizer, http_header_timeout_s=0.2) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answers = []
            for _ in range(2):
                writer.write(request)
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), GENEROUS_S)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                answers.append(head + await reader.readexactly(length))
                await asyncio.sleep(1.0)  # idle for 5 header timeouts
            writer.close()
            return answers

    answers = run(scenario())
    assert all(answer.startswith(b"HTTP/1.1 200") for answer in answers)
