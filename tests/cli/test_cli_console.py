"""The command line's conventions, without a broker: help on every option, --version, one
log format with the libraries kept quiet, librdkafka through Python logging, progress bars
only on a terminal, SIGTERM as Ctrl-C, and train's two-step stop."""

from __future__ import annotations

import argparse
import fcntl
import io
import logging
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from rolloutbus import __version__
from rolloutbus.cli import build_parser
from rolloutbus.cli.console import QUIET_LIBRARIES, graceful_stop_handler
from rolloutbus.config import KafkaConfig
from rolloutbus.kafka.clients import LIBRDKAFKA_LOGGER, idempotent_producer
from tests.helpers import free_port, run_cli

LOG_POLL_S = 0.2  # seconds per producer poll while waiting for librdkafka's first log line
LOG_WAIT_S = 30.0  # seconds; a refused connection is logged within a second or two


def _python(code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, **kwargs
    )


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    return dict(sub.choices)


def test_every_option_of_every_subcommand_has_help_text():
    parser = build_parser()
    missing = []
    for name, sub in {"rolloutbus": parser, **_subcommands(parser)}.items():
        for action in sub._actions:  # noqa: SLF001
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"options without help text: {missing}"
    assert len(_subcommands(parser)) >= 13


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"rolloutbus {__version__}"


def test_broker_status_says_not_running_rather_than_pid_none(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"broker: {{port: {free_port()}, data_dir: '{tmp_path / 'kafka'}'}}\n")
    result = run_cli("broker", "status", "--config", str(cfg))
    assert result.returncode == 3, result.stderr
    assert result.stdout.startswith("broker not running (bootstrap 127.0.0.1:")
    assert "None" not in result.stdout


def test_quiet_libraries_log_at_warning_unless_verbose():
    code = (
        "import logging, sys\n"
        "from rolloutbus.cli.console import setup_logging, QUIET_LIBRARIES\n"
        "setup_logging(sys.argv[1] == 'v')\n"
        "print(*(logging.getLogger(n).getEffectiveLevel() for n in QUIET_LIBRARIES))\n"
        "logging.getLogger('rolloutbus.x').info('ours')\n"
        "logging.getLogger('faust').info('theirs')\n"
    )
    quiet = subprocess.run(
        [sys.executable, "-c", code, "q"], capture_output=True, text=True, timeout=60
    )
    verbose = subprocess.run(
        [sys.executable, "-c", code, "v"], capture_output=True, text=True, timeout=60
    )
    assert quiet.stdout.split() == [str(logging.WARNING)] * len(QUIET_LIBRARIES)
    assert verbose.stdout.split() == [str(logging.DEBUG)] * len(QUIET_LIBRARIES)
    assert " INFO rolloutbus.x: ours" in quiet.stderr and "theirs" not in quiet.stderr
    assert " INFO faust: theirs" in verbose.stderr


def test_aiokafka_lines_repeated_in_an_outage_are_shown_once_ours_every_time():
    """Faust's aiokafka logs a line per reconnect while the broker is away (3,600 in one
    fault row's session worker log): the CLI's handler shows one per kind per 30 s."""
    code = (
        "import logging\n"
        "from rolloutbus.cli.console import setup_logging\n"
        "setup_logging(False)\n"
        "for _ in range(50):\n"
        "    logging.getLogger('aiokafka').error('Unable connect to node with id %s: %s', 1,"
        " OSError(111, 'Connect call failed'))\n"
        "    logging.getLogger('aiokafka.consumer.fetcher').error('Failed fetch from %s', 1)\n"
        "for _ in range(3):\n"
        "    logging.getLogger('rolloutbus.x').error('ours')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = result.stderr.splitlines()
    assert len([line for line in lines if "Unable connect to node" in line]) == 1, lines
    assert len([line for line in lines if "Failed fetch from 1" in line]) == 1, lines
    assert len([line for line in lines if "ERROR rolloutbus.x: ours" in line]) == 3


def test_librdkafka_logs_go_through_python_logging_not_its_own_stderr_lines(capfd, caplog):
    """A producer pointed at a port nothing listens on: librdkafka reports the refused
    connection, through the ``librdkafka`` logger in the one format, not as ``%3|...``."""
    caplog.set_level(logging.DEBUG, logger=LIBRDKAFKA_LOGGER.name)
    producer = idempotent_producer(KafkaConfig(bootstrap_servers=f"127.0.0.1:{free_port()}"))
    deadline = time.monotonic() + LOG_WAIT_S
    while not caplog.records and time.monotonic() < deadline:
        producer.poll(LOG_POLL_S)  # confluent-kafka hands log lines over inside poll()
    assert any("Connection refused" in r.getMessage() for r in caplog.records), caplog.text
    assert {r.name for r in caplog.records} == {"librdkafka"}
    assert "%3|" not in capfd.readouterr().err  # librdkafka's own stderr format


def test_progress_bars_only_on_a_terminal():
    """tqdm bars (ours and transformers') are drawn on a terminal, not into a log file."""
    code = (
        "import sys\n"
        "from rolloutbus.cli.console import setup_logging\n"
        "setup_logging(False)\n"
        "from rolloutbus.producers.publish import _progress\n"
        "bar = _progress(3, True)\n"
        "[bar.update(1) for _ in range(3)]\n"
        "bar.close()\n"
        "from tqdm import tqdm\n"
        "[x for x in tqdm(range(3), desc='theirs')]\n"
    )
    piped = _python(code, env={k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"})
    assert piped.returncode == 0, piped.stderr
    assert piped.stderr == ""
    on_a_terminal = _stderr_on_a_terminal(code)
    assert "publish: 100%" in on_a_terminal and "theirs: 100%" in on_a_terminal


def _stderr_on_a_terminal(code: str) -> str:
    controller, terminal = pty.openpty()
    # a fresh pty is 0 columns wide, where tqdm draws an empty bar
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stderr=terminal, stdout=subprocess.DEVNULL, env=env
    )
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal closed: the process exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait(timeout=60)
    os.close(controller)
    return b"".join(chunks).decode(errors="replace")


def test_sigterm_is_ctrl_c_so_cleanup_runs():
    code = (
        "import sys, time\n"
        "from rolloutbus.cli.console import sigterm_as_ctrl_c\n"
        "sigterm_as_ctrl_c()\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "except KeyboardInterrupt:\n"
        "    print('cleaned up', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert out.strip() == "cleaned up" and proc.returncode == 0


def test_train_stops_after_the_step_on_the_first_signal_and_aborts_on_the_second():
    stop = threading.Event()
    said = io.StringIO()
    handler = graceful_stop_handler(stop, "this step", said)
    handler(signal.SIGTERM, None)
    assert stop.is_set()
    assert said.getvalue() == "stopping after this step (Ctrl-C again to abort)\n"
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, None)


def test_step_log_progress_line_is_a_log_record_off_a_terminal(caplog, capsys):
    from prometheus_client import CollectorRegistry

    from rolloutbus.consumers.training.metrics import TrainerMetrics
    from rolloutbus.consumers.training.step_log import StepLog

    record = {
        "global_step": 1,
        "policy_version": 1,
        "groups": 1,
        "tokens": 4,
        "reward/mean": 0.5,
        "timing/step_s": 1.0,
    }
    caplog.set_level(logging.INFO)
    StepLog(None, TrainerMetrics(CollectorRegistry())).write(record)  # stderr is captured: no tty
    assert capsys.readouterr().err == ""
    [line] = [r.getMessage() for r in caplog.records if "step 1 v1" in r.getMessage()]
    assert line.startswith("step 1 v1 | reward 0.500")


TRAIN_READY_S = 300.0  # seconds until the trainer waits for groups (torch, model, group join)


def test_train_on_sigterm_says_it_stops_after_the_step_and_exits_cleanly(kafka_config, tmp_path):
    """The real command: the first SIGTERM is answered with the line and a clean stop."""
    from rolloutbus.config import Config, ModelConfig, TrainerConfig
    from tests.pipeline import write_config

    cfg = Config(
        kafka=kafka_config,
        model=ModelConfig(name="tiny-qwen3"),
        trainer=TrainerConfig(
            group_id=f"trainer-{time.monotonic_ns()}", default_local_dir=tmp_path
        ),
    )
    with subprocess.Popen(  # on leaving: its pipe closed, the process waited for
        [
            sys.executable,
            "-m",
            "rolloutbus.cli",
            "train",
            "-c",
            str(write_config(cfg, tmp_path / "c.yaml")),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as train:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(train.stderr or []), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + TRAIN_READY_S
            # the trainer client logs its partitions once it waits for groups
            while not any("assigned" in line for line in lines):
                assert train.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
                time.sleep(0.5)
            train.send_signal(signal.SIGTERM)
            train.wait(timeout=120)
            reader.join(timeout=30)
        finally:
            if train.poll() is None:
                train.kill()
    output = "".join(lines)
    assert train.returncode == 0, output[-3000:]
    assert "stopping after this step (Ctrl-C again to abort)" in output
    assert "trained no step (at step 0); 0 stale groups dropped; 0 groups since step 0" in output


def test_the_train_summary_line_tells_this_run_from_the_checkpoints_history():
    """A resumed run of 2 steps on 8 groups, 4 dropped as stale, after 8 groups before it
    (issue 30: it read "trained steps 2..4 (16 groups in all)")."""
    from rolloutbus.consumers.training.grpo import TrainSummary

    summary = TrainSummary(
        started_at_step=2,
        global_step=4,
        policy_version=4,
        groups_trained=16,
        checkpoint=None,
        groups_this_run=8,
        stale_dropped=4,
    )
    assert summary.line() == (
        "trained 2 step(s), 3..4, on 8 groups; 4 stale groups dropped; 16 groups since "
        "step 0; policy version 4; checkpoint None"
    )
