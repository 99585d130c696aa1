"""What a global-checkpoint request may name (ps_server.checkpoints.guard), and who may send one."""

from __future__ import annotations

from pathlib import Path

import pytest
from pshard.common import checkpoint_store as ckpt
from pshard.common.checkpoint_store import CheckpointError
from pshard.common.errors import FutureClockError, InvalidArgumentError, PermissionDeniedError
from pshard.common.security.auth import allowed
from pshard.common.types import SliceKey
from pshard.launcher.plan import ClusterPlan, Options, child_specs
from pshard.ps_server.checkpoints import guard

PS = "/pshard.api.v1.ParameterServerService/"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root" / "ckpt-1").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    return tmp_path / "root"


def test_a_directory_inside_the_root_is_resolved(root: Path) -> None:
    assert guard.confine(str(root), str(root / "ckpt-1")) == (root / "ckpt-1").resolve()
    assert guard.confine(str(root), "ckpt-1") == (root / "ckpt-1").resolve()  # relative to the root
    assert guard.confine(str(root), str(root / "new" / "deeper")) == (root / "new" / "deeper").resolve()


def test_without_a_root_global_checkpoints_are_refused_naming_the_flag(root: Path) -> None:
    for missing in (None, ""):
        with pytest.raises(CheckpointError, match="start it with --global-checkpoint-dir") as caught:
            guard.confine(missing, str(root / "ckpt-1"))
        assert caught.value.status == "FAILED_PRECONDITION"


@pytest.mark.parametrize("directory, error", [
    ("", InvalidArgumentError),
    ("ckpt-1/../../elsewhere", InvalidArgumentError),
    ("..", InvalidArgumentError),
    ("a\x00b", InvalidArgumentError),
    ("x" * 70_000, InvalidArgumentError),
    ("/etc", PermissionDeniedError),
    ("/", PermissionDeniedError),
    (".", PermissionDeniedError),  # the root itself: a checkpoint is a directory inside it
])
def test_anything_outside_the_root_is_refused_naming_the_field_and_value(root: Path, directory: str,
                                                                          error: type[Exception]) -> None:
    with pytest.raises(error, match="directory") as caught:
        guard.confine(str(root), directory)
    assert directory[:20] in str(caught.value) or directory in ("", "a\x00b")


def test_a_sibling_sharing_the_roots_name_prefix_is_outside(root: Path) -> None:
    sibling = root.parent / (root.name + "-other")
    sibling.mkdir()
    with pytest.raises(PermissionDeniedError, match="not inside"):
        guard.confine(str(root), str(sibling))


def test_a_symlink_out_of_the_root_is_refused(root: Path) -> None:
    (root / "escape").symlink_to(root.parent / "elsewhere", target_is_directory=True)
    with pytest.raises(PermissionDeniedError, match="elsewhere"):
        guard.confine(str(root), str(root / "escape"))
    with pytest.raises(PermissionDeniedError):
        guard.confine(str(root), "escape/ckpt-2")


def test_a_root_reached_through_a_symlink_still_confines(root: Path) -> None:
    link = root.parent / "link-to-root"
    link.symlink_to(root, target_is_directory=True)
    assert guard.confine(str(link), str(root / "ckpt-1")) == (root / "ckpt-1").resolve()
    with pytest.raises(PermissionDeniedError):
        guard.confine(str(link), str(root.parent / "elsewhere"))


def _ranges(*items: tuple[str, int, int, int, tuple[int, ...]]) -> dict[SliceKey, ckpt.Range]:
    return {SliceKey(k, part): ckpt.Range(k, offset, numel, shape) for k, part, offset, numel, shape in items}


def test_ranges_name_each_slice_once_inside_its_parameter() -> None:
    good = _ranges(("w", 0, 0, 6, (4, 3)), ("w", 1, 6, 6, (4, 3)), ("b", 0, 0, 3, (3,)))
    guard.check_ranges(good, 3)
    with pytest.raises(InvalidArgumentError, match="twice"):
        guard.check_ranges(good, 4)
    for bad in (("w", 0, 6, 7, (4, 3)), ("w", 0, 0, 0, (4, 3)), ("", 0, 0, 1, (1,)),
                ("w", 0, 2**64 - 1, 1, (4, 3))):
        with pytest.raises(InvalidArgumentError, match="ranges"):
            guard.check_ranges(_ranges(bad), 1)


def test_ranges_must_be_the_slices_held_at_their_sizes() -> None:
    ranges = _ranges(("w", 0, 0, 6, (4, 3)), ("b", 0, 0, 3, (3,)))
    guard.check_held(ranges, {SliceKey("w", 0): 6, SliceKey("b", 0): 3})
    with pytest.raises(InvalidArgumentError, match=r"missing \['x'\]"):
        guard.check_held(ranges, {SliceKey("w", 0): 6, SliceKey("b", 0): 3, SliceKey("x", 0): 1})
    with pytest.raises(InvalidArgumentError, match="not held here"):
        guard.check_held(ranges, {SliceKey("w", 0): 6})
    with pytest.raises(InvalidArgumentError, match="5 on this server"):
        guard.check_held(ranges, {SliceKey("w", 0): 5, SliceKey("b", 0): 3})


def test_a_clock_past_what_the_server_knows_is_refused_naming_both() -> None:
    guard.check_clock(7, newest_version=6, newest_clock=3)  # the step being taken
    guard.check_clock(7, newest_version=0, newest_clock=6)
    with pytest.raises(FutureClockError, match=r"clock 18446744073709551615 .* version is 6 .* to it 3"):
        guard.check_clock(2**64 - 1, newest_version=6, newest_clock=3)
    with pytest.raises(FutureClockError, match="clock 8"):
        guard.check_clock(8, newest_version=6, newest_clock=3)


def test_server_index_is_among_the_servers() -> None:
    guard.check_servers(0, 1)
    for server, servers in ((0, 0), (3, 3), (4, 2)):
        with pytest.raises(InvalidArgumentError, match="server"):
            guard.check_servers(server, servers)


def test_only_the_chief_or_an_admin_checkpoints_and_trainers_may_ask_to_restore() -> None:
    roles = ("chief", "worker", "ps", "scheduler", "evaluator", "admin")
    for method in ("Checkpoint", "SaveCheckpointPart"):
        assert {r for r in roles if allowed(PS + method, r)} == {"chief", "admin"}, method
    for method in ("ExportTable", "CheckpointTables"):
        assert {r for r in roles if allowed("/pshard.api.v1.SparseTablesService/" + method, r)} == {
            "chief", "admin"}, method
    # Every trainer asks before its Declare; the directory is confined by the server's root.
    assert {r for r in roles if allowed(PS + "RestoreCheckpoint", r)} == {"chief", "worker", "admin"}


def test_the_launcher_gives_its_servers_the_trainers_checkpoint_root() -> None:
    def ports(count: int, host: str = "127.0.0.1") -> list[int]:
        return list(range(7000, 7000 + count))

    for args in (("--global-checkpoint-dir", "runs/ckpt"), ("--global-checkpoint-dir=runs/ckpt",)):
        options = Options(worker_args=("--mode", "sync", *args))
        specs = child_specs(ClusterPlan.allocate(2, 1, ports=ports), options)
        servers = [s for s in specs if "pshard.ps_server" in s.argv]
        assert len(servers) == 2
        for spec in servers:
            at = spec.argv.index("--global-checkpoint-dir")
            assert spec.argv[at + 1] == str(Path("runs/ckpt").absolute()), spec.argv
    plain = child_specs(ClusterPlan.allocate(1, 1, ports=ports), Options(worker_args=("--mode", "sync")))
    assert not any("--global-checkpoint-dir" in s.argv for s in plain)
