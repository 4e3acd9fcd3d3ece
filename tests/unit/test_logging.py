"""init() configures hororing's own logger only, never the application's root logger."""

import subprocess
import sys

CHECK = """
import logging, sys
import hororing as hvd
{setup}
hvd.init()
root = logging.getLogger()
mine = logging.getLogger("hororing")
print(len(root.handlers), len(mine.handlers), mine.level == logging.{level})
hvd.shutdown()
"""


def run(setup="", level="WARNING", env=None):
    code = CHECK.format(setup=setup, level=level)
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True, env=env)
    return output.stdout.split()


def test_a_bare_script_gets_a_hororing_handler_and_the_root_logger_is_left_alone():
    assert run() == ["0", "1", "True"]


def test_an_application_that_configured_logging_keeps_its_handlers():
    assert run("logging.basicConfig(level=logging.INFO)") == ["1", "0", "True"]


def test_the_level_comes_from_the_environment():
    import os
    assert run(level="DEBUG", env={**os.environ, "HOROVOD_LOG_LEVEL": "debug"})[2] == "True"
