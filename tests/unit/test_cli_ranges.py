"""Every numeric flag of every entry point is range-checked by common.argtypes: an out-of-range value
is argparse's usage error (exit status 2, one error line naming the flag and the value), never a
traceback at first use nor a silently accepted nonsense."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence

import pytest
from pshard.common.argtypes import (
    MAX_INT,
    float_range,
    int_range,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    replicas,
)


@pytest.mark.parametrize(("parse", "good", "bad"), [
    (positive_int, {"1": 1, str(MAX_INT): MAX_INT},
     ["0", "-1", "1.5", "", " 1", "+1", str(MAX_INT + 1), "9" * 400]),
    (non_negative_int, {"0": 0, "7": 7}, ["-1", "x", "1e3"]),
    (int_range(-3, 3), {"-3": -3, "3": 3}, ["-4", "4", "--3"]),
    (replicas, {"0": 0, "255": 255}, ["-1", "256"]),
    (positive_float, {"0.5": 0.5, "1e9": 1e9}, ["0", "-1", "nan", "inf", "-inf", "1e10", "x"]),
    (non_negative_float, {"0": 0.0, "2.5": 2.5}, ["-5", "-0.1", "nan", "inf"]),
    (float_range(0.0, 1.0), {"0": 0.0, "1": 1.0}, ["1.01", "-0.01", "nan"]),
])
def test_each_type_takes_its_range_and_refuses_the_rest_naming_the_text(
        parse: Callable[[str], float], good: dict[str, float], bad: list[str]) -> None:
    for text, value in good.items():
        assert parse(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=r"got .*, expected"):
            parse(text)


def _call(module: str, function: str = "main") -> Callable[[Sequence[str]], object]:
    return getattr(importlib.import_module(module), function)  # type: ignore[no-any-return]


PS, SCHEDULER, WORKER = "pshard.ps_server.__main__", "pshard.scheduler.__main__", "pshard.worker.__main__"
LAUNCH = "pshard.launcher.cli"
CASES = [
    (PS, ["--max-message-mb", "100000"], "--max-message-mb"),
    (PS, ["--max-message-mb", "0"], "--max-message-mb"),
    (PS, ["--replicas", "-1"], "--replicas"),
    (PS, ["--checkpoint-interval-s", "-5"], "--checkpoint-interval-s"),
    (PS, ["--hang-report-s", "nan"], "--hang-report-s"),
    (PS, ["--staleness", "-1"], "--staleness"),
    (PS, ["--lr", "-0.1"], "--lr"),
    (PS, ["--momentum", "1.5"], "--momentum"),
    (PS, ["--max-inflight-mb", "0"], "--max-inflight-mb"),
    (PS, ["--waste-limit-mb", "-1"], "--waste-limit-mb"),
    (PS, ["--update-threads", "-1"], "--update-threads"),
    (PS, ["--update-threads", "257"], "--update-threads"),
    (PS, ["--pull-timeout-s", "inf"], "--pull-timeout-s"),
    (PS, ["--checkpoint-write-mb-s", "-1"], "--checkpoint-write-mb-s"),
    (PS, ["--task-index", "-1"], "--task-index"),
    (SCHEDULER, ["--heartbeat-interval-ms", "99999999999"], "--heartbeat-interval-ms"),
    (WORKER, ["--replicas", "-1"], "--replicas"),
    (WORKER, ["--staleness", "-2"], "--staleness"),
    (WORKER, ["--lr", "0"], "--lr"),
    (WORKER, ["--momentum", "-1"], "--momentum"),
    (WORKER, ["--weight-decay", "-1"], "--weight-decay"),
    (WORKER, ["--max-steps", "-1"], "--max-steps"),
    (WORKER, ["--seed", "-1"], "--seed"),
    (WORKER, ["--threads", "-1"], "--threads"),
    (WORKER, ["--checkpoint-every-steps", "-1"], "--checkpoint-every-steps"),
    (WORKER, ["--keep-checkpoints", "-1"], "--keep-checkpoints"),
    (WORKER, ["--checkpoint-full-every", "0"], "--checkpoint-full-every"),
    (LAUNCH, ["--workers", "-1"], "--workers"),
    (LAUNCH, ["--replicas", "-1"], "--replicas"),
    (LAUNCH, ["--checkpoint-interval-s", "-5"], "--checkpoint-interval-s"),
    (LAUNCH, ["--max-restarts", "-1"], "--max-restarts"),
    ("pshard.certs", ["--days", "0", "admin"], "--days"),
    ("pshard.certs", ["--days", "10000000", "admin"], "--days"),
    ("pshard.status", ["--timeout-s", "-1"], "--timeout-s"),
    ("pshard.status", ["--watch", "0"], "--watch"),
    ("pshard.checkpoint_cli", ["export", "root", "--out", "o", "--clock", "-1"], "--clock"),
    ("pshard.checkpoint_cli", ["prune", "root", "--keep-checkpoints", "0"], "--keep-checkpoints"),
    ("pshard.checkpoint_cli", ["compact", "root", "--clock", "-1"], "--clock"),
    ("pshard.common.cluster.k8s_tfconfig", ["--job", "j", "--namespace", "n", "--task-type", "ps",
                                    "--task-index", "0", "--replicas", "ps=1", "--port", "70000"], "--port"),
]


@pytest.mark.parametrize(("module", "argv", "flag"), CASES, ids=[f"{m.split('.')[-1]} {' '.join(a)}"
                                                                 for m, a, _ in CASES])
def test_an_out_of_range_flag_is_one_usage_error_with_exit_status_2(
        module: str, argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _call(module)(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"argument {flag}" in errors[0] and "Traceback" not in err, err
