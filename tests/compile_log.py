"""The compile log's INFO lines (logger ``torch_hca.backends.pipeline``), for tests.

Caught by a handler on that logger itself, not by pytest's caplog: other tests may turn the
logger's propagation off (``torch._logging.set_logs``)."""

from __future__ import annotations

import contextlib
import logging

LOGGER = "torch_hca.backends.pipeline"


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def compile_log_lines():
    """A list that receives each message the compile log writes at INFO while the block runs."""
    lines: list[str] = []
    log, handler = logging.getLogger(LOGGER), _Lines(lines)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
