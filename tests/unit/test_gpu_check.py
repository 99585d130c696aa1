"""The GPU check's bookkeeping (bench/gpu_check.py): what it makes of pytest's report and of its figures.

The check itself runs in tests/e2e/test_gpu_check.py; these are the parts whose GPU-side outcomes (a
failing CUDA test, a ratio under the bar) the CPU run never produces.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from bench.gpu_check import Recorder, _junit_counts, guarded, source_digest, summary

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.cuda.test_cuda_paths" name="test_a"/>
<testcase classname="tests.cuda.test_cuda_paths" name="test_b"><failure message="boom"/></testcase>
<testcase classname="tests.cuda.test_cuda_paths" name="test_c"><error message="fixture"/></testcase>
<testcase classname="tests.unit.test_model_device" name="test_d">
<skipped message="needs a CUDA device"/></testcase>
</testsuite></testsuites>"""


def test_junit_counts_name_the_failing_tests(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    assert _junit_counts(path) == {
        "passed": 1, "failed": 2, "skipped": 1,
        "failed_tests": ["tests.cuda.test_cuda_paths::test_b", "tests.cuda.test_cuda_paths::test_c"],
        "skip_reasons": ["needs a CUDA device"]}


def figures(resnet: float, ctr: float, failed: int = 0) -> Recorder:
    rec = Recorder(io.StringIO())
    rec.write("cuda_tests", exit_code=1 if failed else 0, passed=20, failed=failed, skipped=0)
    rec.write("training_resnet18", workers=1, overlap=False, ratio=resnet - 0.1)
    rec.write("training_resnet18", workers=1, overlap=True, ratio=resnet)
    rec.write("training_resnet18", workers=2, overlap=True, ratio=9.0)  # 2 workers: not the bar's figure
    rec.write("ctr_ratio", gpu_to_cpu=ctr)
    return rec


@pytest.mark.parametrize(("resnet", "ctr", "failed", "bars"), [
    (0.75, 3.2, 0, (True, True, True)),
    (0.69, 3.2, 0, (True, False, True)),
    (0.75, 2.9, 0, (True, True, False)),
    (0.75, 3.2, 1, (False, True, True)),
])
def test_summary_checks_each_bar(resnet: float, ctr: float, failed: int, bars: tuple[bool, ...]) -> None:
    rec = figures(resnet, ctr, failed)
    line = summary(rec)
    last = json.loads(rec.out.getvalue().splitlines()[-1])  # type: ignore[attr-defined]
    assert tuple(last["bars"].values()) == bars
    assert last["resnet18_ratio"] == {"no_overlap": round(resnet - 0.1, 10), "overlap": resnet}
    assert line.startswith("gpu-check OK" if all(bars) else "gpu-check DONE WITH MISSES")


def test_a_failing_section_is_recorded_and_the_next_one_runs() -> None:
    rec = Recorder(io.StringIO())

    def broken() -> None:
        raise RuntimeError("no GPU after all")

    guarded(rec, "training", broken)
    guarded(rec, "ctr", lambda: rec.write("ctr", samples_per_s=1.0))
    assert [r["figure"] for r in rec.records] == ["training_error", "ctr"]
    assert rec.records[0]["error"] == "RuntimeError: no GPU after all"
    assert "summary" not in rec.out.getvalue()  # type: ignore[attr-defined]
    assert summary(rec).endswith("errors ['training_error']")


def test_the_source_digest_follows_the_package_sources(tmp_path: Path) -> None:
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "a.py").write_text("x = 1\n")
    (tmp_path / "pshard" / "api" / "v1").mkdir(parents=True)
    before = source_digest(tmp_path)
    # Generated stubs are not sources: the carry regenerates them for the GPU machine's grpcio.
    (tmp_path / "pshard" / "api" / "v1" / "x_pb2.py").write_text("generated = True\n")
    assert source_digest(tmp_path) == before
    (tmp_path / "worker" / "a.py").write_text("x = 2\n")
    assert source_digest(tmp_path) != before
