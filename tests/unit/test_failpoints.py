"""Failpoints (pshard.common.failpoints): parsed once, refused with the field and value when misspelt, and a
`pause` holds a real process's thread, and only it, until SIGUSR1."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from pshard.common.errors import InvalidArgumentError
from pshard.common.failpoints import ENV, parse

from tests.e2e.harness import wait_until


@contextlib.contextmanager
def _paused(code: str, failpoints: str, name: str) -> Iterator[subprocess.Popen[str]]:
    """`code` in a new Python process with PSHARD_FAILPOINTS=`failpoints`, its stdout and stderr piped,
    once it announced its pause at failpoint `name`; killed at the end."""
    env = {**os.environ, ENV: failpoints}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None and proc.stdout is not None
        line = proc.stderr.readline()  # blocks until the pause is announced
        assert line == f"failpoint {name}: paused (pid {proc.pid}); SIGUSR1 resumes it\n"
        yield proc
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def test_parse_reads_names_and_actions() -> None:
    assert parse("") == {}
    assert parse(" worker.before_await_peers=pause , ") == {"worker.before_await_peers": "pause"}


@pytest.mark.parametrize("text", ["worker.before_await_peer=pause", "worker.before_await_peers=stop",
                                  "worker.before_await_peers"])
def test_a_misspelt_failpoint_is_refused_naming_the_variable_and_the_item(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"{ENV}: got '{text}'.*worker.before_await_peers"):
        parse(text)


def test_a_pause_holds_the_calling_thread_while_the_others_run_until_sigusr1() -> None:
    code = ("import threading, time\n"
            "from pshard.common.failpoints import failpoint\n"
            "def tick():\n"
            "    while True:\n"
            "        print('tick', flush=True)\n"
            "        time.sleep(0.05)\n"
            "threading.Thread(target=tick, daemon=True).start()\n"
            "failpoint('worker.before_await_peers')\n"
            "print('after', flush=True)\n")
    with _paused(code, "worker.before_await_peers=pause", "worker.before_await_peers") as proc:
        assert proc.stderr is not None and proc.stdout is not None
        ticks = [proc.stdout.readline() for _ in range(3)]  # the other thread goes on meanwhile
        assert ticks == ["tick\n"] * 3 and proc.poll() is None
        os.kill(proc.pid, signal.SIGUSR1)
        wait_until(lambda: proc.stdout is not None and proc.stdout.readline() == "after\n", 30.0,
                   "the paused thread going on")


def test_a_pause_off_the_main_thread_holds_that_thread_until_sigusr1() -> None:
    """A server replays a primary's copy on an executor thread (ps.before_replica_apply): it pauses too."""
    code = ("import threading\n"
            "from pshard.common.failpoints import failpoint\n"
            "def run():\n"
            "    failpoint('ps.before_replica_apply')\n"
            "    print('after', flush=True)\n"
            "t = threading.Thread(target=run, name='side'); t.start(); t.join()\n")
    with _paused(code, "ps.before_replica_apply=pause", "ps.before_replica_apply") as proc:
        assert proc.stderr is not None and proc.stdout is not None
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGUSR1)
        assert proc.stdout.readline() == "after\n"
        assert proc.wait(timeout=30) == 0


def test_pause_once_holds_only_the_first_thread_that_reaches_it() -> None:
    """A backup reaches ps.before_replica_apply with every batch: once resumed, the copy must go on."""
    code = ("from pshard.common.failpoints import failpoint\n"
            "failpoint('ps.before_replica_apply')\n"
            "print('after one', flush=True)\n"
            "failpoint('ps.before_replica_apply')\n"
            "print('after two', flush=True)\n")
    with _paused(code, "ps.before_replica_apply=pause-once", "ps.before_replica_apply") as proc:
        assert proc.stderr is not None and proc.stdout is not None
        os.kill(proc.pid, signal.SIGUSR1)
        assert [proc.stdout.readline(), proc.stdout.readline()] == ["after one\n", "after two\n"]
        assert proc.wait(timeout=30) == 0 and proc.stderr.read() == ""


def test_a_pause_in_a_process_that_imported_failpoints_off_the_main_thread_fails_saying_why() -> None:
    code = ("import threading\n"
            "def run():\n"
            "    from pshard.common.failpoints import failpoint\n"
            "    try:\n"
            "        failpoint('worker.before_await_peers')\n"
            "    except RuntimeError as e:\n"
            "        print(e)\n"
            "t = threading.Thread(target=run, name='side'); t.start(); t.join()\n")
    env = {**os.environ, ENV: "worker.before_await_peers=pause"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert "reached on thread 'side', but pshard.common.failpoints was imported off the main thread" in (
        done.stdout), done


def test_without_the_variable_a_failpoint_does_nothing() -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    done = subprocess.run([sys.executable, "-c", "from pshard.common.failpoints import failpoint\n"
                           "failpoint('worker.before_await_peers')\nprint('through')"],
                          env=env, capture_output=True, text=True, timeout=30)
    assert done.stdout == "through\n" and done.returncode == 0
