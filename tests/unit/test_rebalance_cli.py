"""`pshard rebalance`'s plan and `pshard status`'s load and move tables (issue 20, items 3 and 5): pure parts,
driven with made-up loads."""

from __future__ import annotations

import pytest
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.cluster.loads import ServerLoad
from pshard.common.cluster.view import ClusterView

from pshard.rebalance_cli import build_parser, plan, plan_lines
from pshard.status import LoadReport, MoveReport, render, summarise

SERVERS = ("a:1", "b:1", "c:1")


def _layout():
    return plan_layout([ParamSpec("w", "float32", (4,))], SERVERS, replicas=1, row_partitions=12)


def _loads(rates: dict[int, float]) -> list[ServerLoad]:
    layout = _layout()
    return [ServerLoad(address, rows_per_s={p: rates.get(p, 0.0) for p in layout.partitions_on(i)},
                       partition_bytes={p: 1000 + p for p in layout.partitions_on(i)})
            for i, address in enumerate(SERVERS)]


def test_the_plan_moves_hot_partitions_to_the_backup_of_their_server_or_elsewhere_after_a_copy():
    layout = _layout()  # partitions 1, 4, 7, 10 on b:1, whose backup is c:1
    planned = plan(layout, _loads({1: 100.0, 4: 100.0, 7: 100.0, 10: 100.0, 0: 5.0}), set(SERVERS), 1.2)
    assert [(m.item, m.source, m.target) for m in planned.to_backup] == [(1, 1, 2)]
    assert [(m.item, m.source, m.target) for m in planned.need_copy] == [(4, 1, 0)]
    lines = plan_lines(planned)
    assert lines[0] == "layout version 0: 12 row partitions on 3 servers, mean load 135.0 rows/s"
    assert lines[3].split() == ["0", "a:1", "5.0", "105.0", "0.78"]  # now, and after every move of the plan
    assert lines[4].split() == ["1", "b:1", "400.0", "200.0", "1.48"]
    assert lines[5].split() == ["2", "c:1", "0.0", "100.0", "0.74"]
    (to_backup,) = [line for line in lines if line.endswith("to its backup")]
    assert to_backup.split()[:7] == ["1", "1", "b:1", "2", "c:1", "100.0", "1001"]
    (copied,) = [line for line in lines if line.endswith("after a catch-up copy")]
    assert copied.split()[:7] == ["4", "1", "b:1", "0", "a:1", "100.0", "1004"]


def test_a_balanced_job_plans_nothing_and_says_so():
    planned = plan(_layout(), _loads({p: 10.0 for p in range(12)}), set(SERVERS), 1.2)
    assert planned.plan.moves == () and "nothing to move" in plan_lines(planned)[-1]


def test_a_dead_server_neither_gives_nor_takes():
    planned = plan(_layout(), _loads({1: 100.0, 4: 100.0}), {"a:1", "b:1"}, 1.2)
    assert all(2 not in (m.source, m.target) for m in planned.plan.moves)


def test_a_threshold_below_the_mean_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--threshold", "0.9"])
    assert "argument --threshold: got 0.9, expected a number >= 1.0" in capsys.readouterr().err


def test_status_lists_each_servers_load_the_hottest_partitions_and_moves_with_bytes_copied_and_left():
    loads = [LoadReport("ps-0", "a:1", 2048.0, 4096.0, {0: 5.0, 3: 250.0}, {0: 1024, 3: 2048}),
             LoadReport("ps-1", "b:1", 0.0, 0.0, {1: 0.0}, {1: 0})]
    moves = [MoveReport(3, "a:1", "c:1", 4, 4096, 1024, 3072, 1.5, False)]
    text = render(summarise("s:1", ClusterView(3, ()), [], loads=loads, moves=moves))
    lines = text.splitlines()
    assert lines[lines.index(next(line for line in lines if line.startswith("LOAD"))) + 1].split() == [
        "ps-0", "2.0", "KiB/s", "4.0", "KiB/s", "255.0", "2"]
    hot = lines.index(next(line for line in lines if line.startswith("HOT PARTITION")))
    assert [line.split()[:3] for line in lines[hot + 1:hot + 3]] == [["3", "ps-0", "250.0"],
                                                                      ["0", "ps-0", "5.0"]]
    (move,) = [line for line in lines if line.startswith("partition 3")]
    assert move.split() == ["partition", "3", "in", "progress", "a:1", "c:1", "4", "1.0", "KiB", "3.0", "KiB",
                            "1.50", "s"]
