"""One log format for every process: a JSON object per line on stderr, UTC timestamps,
tracebacks as structured fields, and the process's name on every line.

structlog loggers (the gateway's, the scheduler's) and the standard library's (the core,
the executor, the kernels, and third-party libraries) render through the same processors,
so a line reads the same whichever logger wrote it. Called once by each ``__main__``;
library code only asks for a logger.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(process: str, level: int = logging.INFO, **context) -> None:
    """Every line of this process: ``{"event", "level", "timestamp", "process", ...}``;
    ``context`` (a TP rank, say) joins every line too."""
    fixed = {"process": process, **context}

    def add_fixed(_, __, event_dict):
        for key, value in fixed.items():
            event_dict.setdefault(key, value)
        return event_dict

    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_fixed,
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.dict_tracebacks,
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.dict_tracebacks,
                    structlog.processors.JSONRenderer()]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
