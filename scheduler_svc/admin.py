"""The scheduler's admin plane: its config changed live, block tables on demand.

Every live change takes the one validated path of docs/design.md §6a. ``ConfigAdmin``
owns the config's versions (author, time, reason; in ``history`` and the telemetry
store). A change is validated by building a new SchedulerConfig; a refused one raises
ConfigError (``LiveChangeError`` for a field that cannot change while running) and
changes nothing; an accepted one goes to ``EngineLoop.reconfigure`` on the loop's own
event loop, so the next plan is the first built with it.

Everything the core reads each step may change live; lowering ``max_num_seqs`` below the
running count preempts nobody. Refused live: ``enable_prefix_caching`` (the KV pool is
built with it) and ``max_num_batched_tokens`` above its startup value (the executor
sized its memory for it). ``SchedulerAdminServicer`` is the gRPC face.
"""

from __future__ import annotations

import dataclasses
import time

import grpc
import structlog

from protos.continuum.v1 import scheduler_pb2 as pb
from protos.continuum.v1 import scheduler_pb2_grpc
from scheduler_svc import config_file
from scheduler_svc.core import ConfigError, RequestStatus, SchedulerConfig
from scheduler_svc.loop import EngineLoop
from scheduler_svc.streams import KEY_SEPARATOR
from telemetry import BlockTableSnapshot, ConfigRecord

MAX_AUTHOR_CHARS = 64
MAX_REASON_CHARS = 500
FIXED_AT_START = {
    "enable_prefix_caching": "the KV pool is built with it when an executor registers",
}
log = structlog.get_logger("scheduler.admin")


class LiveChangeError(ConfigError):
    """A valid value for a field that cannot change while the scheduler runs."""


class ConfigAdmin:
    """The config's versions and the one place that changes the running config."""

    def __init__(self, loop: EngineLoop, startup: SchedulerConfig,
                 flags: SchedulerConfig | None = None, source: str = "command line",
                 first_version: int = 1) -> None:
        """``startup``: the config the scheduler started with (version ``first_version``:
        1, or one past the telemetry store's newest, whose primary key it is, so that
        versions go on rising across restarts); ``flags``: the command line's alone,
        which a config file's content is laid over."""
        self.loop = loop
        self.first_version = first_version
        self.startup = startup
        self.flags = flags or startup
        self.history: list[ConfigRecord] = []
        self._record(startup, "startup", f"scheduler start ({source})")

    @property
    def current(self) -> ConfigRecord:
        return self.history[-1]

    def set(self, changes: dict[str, object], author: str, reason: str) -> ConfigRecord:
        """Applies ``changes`` (field -> value, text or typed) over the current config."""
        if not changes:
            raise ConfigError("nothing to set: give at least one field=value")
        values = config_file.parse_values(changes)
        return self.apply(dataclasses.replace(self.loop.core.config, **values), author, reason)

    def rollback(self, version: int, author: str) -> ConfigRecord:
        """The values of ``version`` as a new version; KeyError for an unknown one."""
        old = next((r for r in self.history if r.version == version), None)
        if old is None:
            raise KeyError(f"no config version {version}; this scheduler has versions "
                           f"{self.first_version} to {self.current.version}")
        return self.apply(SchedulerConfig(**old.values), author, f"rollback to {version}")

    def apply_file(self, values: dict[str, object]) -> ConfigRecord:
        """A config file's new content, laid over the command-line config."""
        return self.apply(config_file.overlay(self.flags, values), "config-file",
                          "the config file changed")

    def apply(self, new: SchedulerConfig, author: str, reason: str) -> ConfigRecord:
        """Makes ``new`` the running config (a new version) unless it equals the current
        one; raises LiveChangeError for a change the running scheduler cannot take."""
        old = self.loop.core.config
        for name, why in FIXED_AT_START.items():
            if getattr(new, name) != getattr(old, name):
                raise LiveChangeError(f"{name} cannot change while the scheduler runs "
                                      f"({why}); restart the scheduler to change it")
        limit = self.startup.max_num_batched_tokens
        if new.max_num_batched_tokens > limit:
            raise LiveChangeError(
                f"max_num_batched_tokens cannot rise above its startup value {limit} while "
                f"the scheduler runs (the executor sized its memory for that step); restart "
                "with a larger --max-num-batched-tokens")
        if new == old:
            return self.current
        self.loop.reconfigure(new)
        record = self._record(new, author, reason)
        changed = {k: v for k, v in record.values.items()
                   if self.history[-2].values.get(k) != v}
        log.info("config changed", version=record.version, author=author, reason=reason,
                 changed=changed)
        return record

    def _record(self, config: SchedulerConfig, author: str, reason: str) -> ConfigRecord:
        record = ConfigRecord(self.first_version + len(self.history),
                              dataclasses.asdict(config), author,
                              time.time(), reason)
        self.history.append(record)
        if self.loop.recorder is not None:
            self.loop.recorder.writer.put(record)
        return record

    def snapshot(self) -> tuple[int, float, list[tuple[str, BlockTableSnapshot]]]:
        """(snapshot id, time, (tenant, block table) per running or swapped sequence);
        written to the telemetry store too (its request id is the client's, as in the
        sequences table). The id is the time in microseconds: unique across restarts
        of one store, and ordered."""
        taken_at = time.time()
        snapshot_id = int(taken_at * 1e6)
        bm = self.loop.core.block_manager
        tables = []
        for key, req in (self.loop.core.requests.items() if bm is not None else ()):
            request_id = key.split(KEY_SEPARATOR, 1)[-1]
            swapped = req.status == RequestStatus.SWAPPED
            if req.status != RequestStatus.RUNNING and not swapped:
                continue
            blocks = bm.host_table(req.seq_id) if swapped else bm.block_table(req.seq_id)
            tables.append((req.tenant, BlockTableSnapshot(
                snapshot_id, taken_at, request_id, tuple(blocks), swapped)))
        recorder = self.loop.recorder
        if recorder is not None:
            for _, table in tables:
                recorder.writer.put(table)
        return snapshot_id, taken_at, tables


def _version_pb(record: ConfigRecord) -> pb.ConfigVersion:
    return pb.ConfigVersion(
        version=record.version, author=record.author, set_at=record.set_at,
        reason=record.reason,
        values={k: config_file.format_value(v) for k, v in record.values.items()})


def _checked_text(value: str, what: str, limit: int, required: bool) -> str | None:
    """None when ``value`` is fine, else the problem."""
    if required and not value.strip():
        return f"{what} is required (who is changing the config, e.g. your name or 'cli')"
    if len(value) > limit or not value.isprintable():
        return f"{what} must be printable text of at most {limit} characters"
    return None


class SchedulerAdminServicer(scheduler_pb2_grpc.SchedulerAdminServicer):
    def __init__(self, admin: ConfigAdmin) -> None:
        self.admin = admin

    async def GetConfig(self, request, context):  # noqa: N802
        return _version_pb(self.admin.current)

    async def ConfigHistory(self, request, context):  # noqa: N802
        return pb.ConfigHistoryResponse(versions=[_version_pb(r) for r in self.admin.history])

    async def SetConfig(self, request: pb.SetConfigRequest, context):  # noqa: N802
        await self._check_caller(request.author, request.reason, context)
        return await self._answer(context, self.admin.set, dict(request.values),
                                  request.author.strip(), request.reason.strip())

    async def Rollback(self, request: pb.RollbackRequest, context):  # noqa: N802
        await self._check_caller(request.author, "", context)
        return await self._answer(context, self.admin.rollback, request.version,
                                  request.author.strip())

    async def SnapshotBlockTables(self, request, context):  # noqa: N802
        snapshot_id, taken_at, tables = self.admin.snapshot()
        bm = self.admin.loop.core.block_manager
        return pb.SnapshotBlockTablesResponse(
            snapshot_id=snapshot_id, taken_at=taken_at,
            num_total_blocks=bm.num_blocks if bm else 0,
            num_free_blocks=bm.num_free_blocks if bm else 0,
            tables=[pb.BlockTable(request_id=t.request_id, tenant=tenant,
                                  block_ids=t.block_ids, is_swapped=t.is_swapped)
                    for tenant, t in tables])

    @staticmethod
    async def _check_caller(author: str, reason: str, context) -> None:
        problem = (_checked_text(author, "author", MAX_AUTHOR_CHARS, True)
                   or _checked_text(reason, "reason", MAX_REASON_CHARS, False))
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)

    @staticmethod
    async def _answer(context, change, *args) -> pb.ConfigVersion:
        try:
            return _version_pb(change(*args))
        except LiveChangeError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, exc.args[0])
