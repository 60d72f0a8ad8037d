"""kvdepot's library loggers stay silent until the application configures logging."""

from __future__ import annotations

import subprocess
import sys

LOG_EVERY_LEVEL = (
    "from kvdepot.transport._log import get_logger\n"
    "log = get_logger('kvdepot.transport.example').bind(peer='p')\n"
    "log.debug('quiet_debug', n=1)\n"
    "log.info('quiet_info')\n"
    "log.warning('quiet_warning')\n"
    "log.error('quiet_error')\n"
)


def run(program: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True)


def test_a_program_that_configured_no_logging_sees_nothing():
    done = run(LOG_EVERY_LEVEL)
    assert done.stdout == ""
    assert done.stderr == ""


def test_a_program_that_configured_the_standard_librarys_logging_gets_the_events_there():
    done = run("import logging; logging.basicConfig(level=logging.INFO)\n" + LOG_EVERY_LEVEL)
    assert done.stdout == ""
    assert "quiet_debug" not in done.stderr
    assert "event='quiet_info'" in done.stderr
    assert "peer='p'" in done.stderr
    assert "kvdepot.transport.example" in done.stderr


def test_a_program_that_configured_structlog_gets_the_events_through_it():
    done = run("import structlog; structlog.configure()\n" + LOG_EVERY_LEVEL)
    assert "quiet_debug" in done.stdout  # structlog's own defaults, as the program asked
    assert "quiet_error" in done.stdout
