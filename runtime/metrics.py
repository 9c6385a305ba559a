"""Prometheus text exposition (format 0.0.4) behind both ``/metrics`` pages: a declared
family (runtime/metric_names.py declares them all), the histogram, the values a process
holds. A page is its families' ``lines``, joined. Ours, not prometheus_client's: the
gateway observes every token gap and the replica renders its page on the scheduling loop
every 50 ms, and this is 6x cheaper per observe and 15-35x per render (docs/facts.md).

A family renders ``(label values, value)`` pairs, the values in the order it declares its
labels (their order on the wire), a ``Histogram`` as a histogram's value; they come from a
``Metric`` the process holds or from state read at render time.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"


def number(value: float) -> str:
    """A sample value as Prometheus writes it (``1.0``, ``+Inf``, ``NaN``)."""
    if value.__class__ is int:  # most samples are counts: ``N.0``, as its float prints
        return f"{value}.0"
    value = float(value)
    if math.isfinite(value):
        return repr(value)
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")


def escape(value: str) -> str:
    """A label value between its quotes."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


@functools.lru_cache(maxsize=4096)  # label sets are few and recur on every render
def _label_text(keys: tuple[str, ...], values: tuple[str, ...]) -> str:
    return ",".join([f'{k}="{escape(v)}"' for k, v in zip(keys, values, strict=True)])


class Histogram:
    """Cumulative-bucket histogram of one label set; ``observe`` is a bisect and two adds
    (``le`` is inclusive: a value equal to a bound counts in that bound's bucket)."""

    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # per bucket, not cumulative; last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


class Family:
    """One metric family as the name table declares it. ``lines`` renders its HELP and
    TYPE and then one sample per pair (a counter's samples end in ``_total``, as
    prometheus_client writes them); a family with no pairs is its header alone."""

    __slots__ = ("name", "kind", "help", "labels", "buckets", "_sample", "_head", "_les")

    def __init__(self, name: str, kind: str, help: str,  # noqa: A002 (Prometheus' word)
                 labels: tuple[str, ...] = ("model_name",),
                 buckets: tuple[float, ...] = ()) -> None:
        assert kind in (COUNTER, GAUGE, HISTOGRAM), kind
        assert (kind == HISTOGRAM) == bool(buckets), f"{name}: buckets are a histogram's"
        assert list(buckets) == sorted(set(buckets)), f"{name}: buckets must increase"
        self.name, self.kind, self.help = name, kind, help
        self.labels, self.buckets = labels, buckets
        self._sample = f"{name}_total" if kind == COUNTER else name
        text = help.replace("\\", "\\\\").replace("\n", "\\n")
        self._head = f"# HELP {self._sample} {text}\n# TYPE {self._sample} {kind}\n"
        self._les = tuple(f'"{number(b)}"' for b in buckets) + ('"+Inf"',)

    def lines(self, samples: Iterable[tuple[tuple[str, ...], object]]) -> str:
        out = [self._head]
        for values, value in samples:
            labels = _label_text(self.labels, values)
            if self.kind == HISTOGRAM:
                out.append(self._histogram(labels, value))
            else:
                out.append(f"{self._sample}{{{labels}}} {number(value)}\n" if labels
                           else f"{self._sample} {number(value)}\n")
        return "".join(out)

    def _histogram(self, labels: str, hist: Histogram) -> str:
        name = self.name
        bucket = f"{name}_bucket{{{labels},le=" if labels else f"{name}_bucket{{le="
        out, total = [], 0
        for le, n in zip(self._les, hist.counts, strict=True):
            total += n  # an int: ``N.0`` is its float's repr
            out.append(f"{bucket}{le}}} {total}.0\n")
        braces = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{braces} {number(hist.sum)}\n"
                   f"{name}_count{braces} {hist.count}.0\n")
        return "".join(out)


class Metric:
    """The values this process holds for one family, one child per label values: a
    number for a counter or gauge (``inc``, ``set``), a ``Histogram`` for a histogram
    (``child``; a hot path resolves it once and observes on it)."""

    __slots__ = ("family", "children")

    def __init__(self, family: Family) -> None:
        self.family = family
        self.children: dict[tuple[str, ...], object] = {}

    def inc(self, values: tuple[str, ...], amount: float = 1) -> None:
        self.children[values] = self.children.get(values, 0) + amount

    def set(self, values: tuple[str, ...], value: float) -> None:
        self.children[values] = value

    def child(self, values: tuple[str, ...]) -> Histogram:
        hist = self.children.get(values)
        if hist is None:
            hist = self.children[values] = Histogram(self.family.buckets)
        return hist

    def lines(self) -> str:
        return self.family.lines(self.children.items())

