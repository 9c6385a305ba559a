"""The stream fan-out benchmark streams what it says through real gRPC: every stream on
one SubmitMany call gets one message per step, read by the gateway's own multiplexer in
another process (a multiprocessing spawn), and its arguments are checked (figures are for
the benchmark to print)."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks import bench_stream_fanout

pytestmark = pytest.mark.spawns  # starts processes of its own (tests/tiers.py)


def test_submit_many_reaches_every_stream_of_the_gateways_multiplexer():
    """Each stream read to its finish, so the client process ends and reports its CPU."""
    fan, messages, cpu = asyncio.run(bench_stream_fanout.many_fanout(8, 5))
    assert len(fan) == 5 and min(fan) > 0 and cpu > 0
    assert messages == 8 * 5 + 8  # a message per stream per step, and each one's end


def test_streams_that_fell_behind_send_what_they_owe_in_one_message():
    fan, messages, _ = asyncio.run(bench_stream_fanout.many_fanout(8, 5, behind=3))
    assert len(fan) == 5 and messages == 8 * 5 + 8  # 3 tokens each, still one message


def test_a_stream_interval_sends_the_first_token_then_messages_of_that_many():
    fan, messages, _ = asyncio.run(bench_stream_fanout.many_fanout(8, 8, interval=4))
    # tokens 0..7 of each stream: [0], [1, 2, 3, 4], then [5, 6, 7] with the end
    assert len(fan) == 8 and messages == 8 * 3


def test_the_table_has_a_row_per_size(capsys):
    bench_stream_fanout.main(["--streams", "2", "4", "--steps", "3"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[0] == "streams" and [r.split()[0] for r in rows[1:]] == ["2", "4"]


@pytest.mark.parametrize("argv", [["--streams", "0"], ["--steps", "1"], ["--behind", "0"],
                                  ["--interval", "0"]])
def test_bad_arguments_are_one_clear_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_stream_fanout.main(argv)
    error = capsys.readouterr().err
    assert exc.value.code == 2 and "--streams, --behind and --interval must be positive" in error
