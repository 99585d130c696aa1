"""``pshard``: one command for every role.

    pshard scheduler ...   the scheduler service
    pshard ps ...          one parameter server
    pshard worker ...      one worker (also chief and evaluator tasks)
    pshard launch ...      a whole local cluster as real processes
    pshard run ...         whatever role TF_CONFIG's task.type names (one image for every TFJob replica)
    pshard health ...      the gRPC health probe that containers and pods use
    pshard status ...      a running job at a glance (scheduler view and every server's stats)
    pshard drain ...       hand a parameter server's slices to its backup; the server then leaves
    pshard rebalance ...   move hot table row partitions from the busiest servers to their backups
    pshard plot ...        loss and accuracy curves from metrics JSON lines
    pshard evaluate ...    reload a saved model and print its test accuracy
    pshard certs ...       a development CA and a certificate per node (mTLS)
    pshard checkpoint ...  list, export or prune global checkpoints

Each subcommand takes the same flags as ``python -m pshard.<service>``; everything after the
subcommand is handed to it unchanged, and its usage and error lines name it ``pshard <command>``.
Services are imported only when chosen, so ``pshard --help`` and ``pshard ps`` never import torch.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    module: str  # whose main(argv) runs it
    help: str
    # Servers stop quietly on SIGTERM from the first line (pshard.common.entry); the worker and the
    # launcher handle signals themselves.
    quiet_stop: bool = False


COMMANDS: dict[str, Command] = {
    "scheduler": Command("pshard.scheduler.__main__", "run the scheduler (membership, barriers, layout)",
                         quiet_stop=True),
    "ps": Command("pshard.ps_server.__main__", "run one parameter server", quiet_stop=True),
    "worker": Command("pshard.worker.__main__", "run one worker, chief or evaluator"),
    "launch": Command("pshard.launcher.__main__", "run a whole local cluster as real processes"),
    "run": Command("", "run the role TF_CONFIG's task.type names"),
    "health": Command("pshard.common.rpc.health", "probe a service's gRPC health check"),
    "status": Command("pshard.status", "show a running job: members, clocks, lag, servers, who waits"),
    "drain": Command("pshard.drain_cli", "hand a parameter server's slices to its backup; it then leaves"),
    "rebalance": Command("pshard.rebalance_cli", "move hot table row partitions from the busiest servers to "
                         "their backups"),
    "plot": Command("pshard.plot", "draw loss and accuracy curves from metrics JSON lines"),
    "evaluate": Command("pshard.evaluate", "reload a saved model and print its test accuracy"),
    "certs": Command("pshard.certs", "make a development CA and node certificates (kept once made)"),
    "checkpoint": Command("pshard.checkpoint_cli",
                          "list, export (torch state_dict) or prune global checkpoints"),
}

# TF_CONFIG task type (any case, as TensorFlow reads it) -> subcommand; "master" is the old chief.
ROLE_COMMAND = {"scheduler": "scheduler", "ps": "ps", "chief": "worker", "master": "worker",
                "worker": "worker", "evaluator": "worker"}

RUN_HELP = """usage: pshard run [flags of the role's command]

Starts the role that TF_CONFIG's task.type names, so that one image serves every replica of a
TFJob: scheduler -> 'pshard scheduler', ps -> 'pshard ps', chief, master, worker and evaluator ->
'pshard worker'. Flags after 'run' go to that command; 'pshard <command> --help' lists them.
In a coordinator's job (docs/guide/coordinator.md) set PSHARD_SERVE=1 on the workers: they serve the
functions the chief schedules ('pshard worker --serve'); the chief runs the coordinator's script."""


def _usage() -> str:
    lines = ["usage: pshard <command> [args...]", "", "pshard: a parameter server for PyTorch training.",
             "", "commands:"]
    lines += [f"  {name:<10} {command.help}" for name, command in COMMANDS.items()]
    lines += ["", "'pshard <command> --help' describes a command's flags."]
    return "\n".join(lines)


class RoleError(Exception):
    """TF_CONFIG names no role that 'pshard run' can start."""


def role_command(environ: Mapping[str, str]) -> str:
    """The subcommand for TF_CONFIG's task.type; raises RoleError when it is missing or unknown."""
    raw = environ.get("TF_CONFIG")
    if not raw:
        raise RoleError("TF_CONFIG is not set; 'pshard run' starts the role its task.type names "
                        "(or use 'pshard scheduler|ps|worker')")
    try:
        task_type = json.loads(raw)["task"]["type"]
    except (ValueError, TypeError, KeyError):
        # Not JSON, or no task.type: the worker's TF_CONFIG parser names the field and the value.
        return "worker"
    command = ROLE_COMMAND.get(task_type.lower()) if isinstance(task_type, str) else None
    if command is None:
        raise RoleError(f"task.type: got {task_type!r}, expected one of {sorted(ROLE_COMMAND)}")
    return command


# Modules that only an optional extra installs (pyproject.toml), and that extra: a command that needs one
# says which `pip install` brings it instead of ending in a traceback (the server image has no torch).
EXTRA_OF = {"torch": "worker", "tqdm": "worker", "sklearn": "worker", "tensorboard": "worker",
            "matplotlib": "plot"}


def missing_extra(err: ModuleNotFoundError, prog: str) -> str | None:
    """The one line that says which extra brings the module `err` names, or None if no extra does."""
    top = (err.name or "").partition(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return None
    return (f"{prog}: error: this command needs {top}, which is not installed: "
            f"pip install '.[{extra}]' in a clone of pshard")


def run_command(command: str, argv: Sequence[str], prog: str) -> int:
    """Import `command`'s module and run its main; usage and errors name `prog`."""
    from pshard.common.entry import die_with_launcher, stop_quietly_on_signals

    if COMMANDS[command].quiet_stop:
        # Before the import: grpc and numpy take a while to load on a busy machine.
        stop_quietly_on_signals()
    die_with_launcher()
    try:
        main: Callable[..., int | None] = importlib.import_module(COMMANDS[command].module).main
        return int(main(argv, prog=prog) or 0)
    except ModuleNotFoundError as err:
        line = missing_extra(err, prog)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        from pshard import __version__

        print(f"pshard {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"{_usage()}\n\npshard: error: unknown command {command!r}", file=sys.stderr)
        return 2
    prog = f"pshard {command}"
    if command == "run":
        if rest[:1] in (["-h"], ["--help"]):
            print(RUN_HELP)
            return 0
        try:
            command = role_command(os.environ)
        except RoleError as err:
            print(f"{prog}: error: {err}", file=sys.stderr)
            return 2
    return run_command(command, rest, prog)


if __name__ == "__main__":
    sys.exit(main())
