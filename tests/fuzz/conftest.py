"""The fuzz tests' share of make fuzz's budget, and the case count and seed in the summary."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fuzz.harness import COUNTER, FUZZ, FUZZ_CASES, FUZZ_SECONDS, FUZZ_SEED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The strategies' own checks (test_strategies.py) run no cases against a service: no share.
    COUNTER.fuzz_tests = max(1, sum(1 for item in items if "tests/fuzz/" in item.nodeid
                                    and "tests/fuzz/test_strategies.py" not in item.nodeid))


def pytest_report_header(config: pytest.Config) -> str | None:
    if not FUZZ:
        return None
    budget = f"{FUZZ_SECONDS:g} s" if FUZZ_SECONDS else f"{FUZZ_CASES} cases"
    return f"fuzz: seed {FUZZ_SEED} (replay with PSHARD_FUZZ_SEED={FUZZ_SEED}), budget {budget}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if COUNTER.cases:
        seed = f", seed {FUZZ_SEED}" if FUZZ else " (derandomized)"
        terminalreporter.write_line(f"fuzz: {COUNTER.cases} cases against live services{seed}")
