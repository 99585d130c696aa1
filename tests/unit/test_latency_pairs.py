"""bench.latency_pairs' summary: medians per checkout, and ratios taken block by block to the first."""

from __future__ import annotations

import pytest

from bench.latency_pairs import build_parser, paired_summary


def _block(p50: float, client: float, server: float) -> dict[str, float]:
    return {"p50_us": p50, "client_us": client, "server_us": server, "load1": 1.0}


def test_ratios_are_taken_within_each_round_so_a_load_swing_cancels() -> None:
    # Round 2 ran on a host twice as loaded: both checkouts doubled, the ratio did not move.
    base = [_block(100, 50, 80), _block(200, 100, 160), _block(110, 55, 88)]
    other = [_block(90, 45, 72), _block(180, 90, 144), _block(99, 49.5, 79.2)]
    summary = paired_summary({"a": base, "b": other}, "a")
    assert summary["a"]["ratio_p50_us"] == 1.0
    assert summary["b"]["ratio_p50_us"] == pytest.approx(0.9)
    assert summary["b"]["ratio_server_us"] == pytest.approx(0.9)
    assert summary["b"]["p50_us"] == 99  # the plain median moves with the load
    assert summary["a"]["client_us"] == 55


def test_checkouts_with_different_block_counts_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="b: 1 blocks, a has 2"):
        paired_summary({"a": [_block(1, 1, 1)] * 2, "b": [_block(1, 1, 1)]}, "a")


def test_fewer_than_two_checkouts_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.latency_pairs import main
    with pytest.raises(SystemExit) as info:
        main(["/tmp"])
    assert info.value.code == 2
    assert "two checkouts or more" in capsys.readouterr().err
    assert build_parser().parse_args(["x", "y"]).blocks == 40


def test_a_tree_written_with_tls_runs_the_same_checkout_over_tls() -> None:
    from bench.latency_pairs import split_tree
    assert split_tree("/src/old:tls") == ("/src/old", True)
    assert split_tree("/src/old") == ("/src/old", False)
    assert split_tree(".:tls") == (".", True)
