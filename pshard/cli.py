"""``pshard``: one command for every role.

    pshard scheduler ...   the scheduler service
    pshard ps ...          one parameter server
    pshard worker ...      one worker (also chief and evaluator tasks)
    pshard launch ...      a whole local cluster as real processes
    pshard run ...         whatever role TF_CONFIG's task.type names (one image for every TFJob replica)
    pshard health ...      the gRPC health probe that containers and pods use

Each subcommand takes the same flags as ``python -m pshard.<service>``; everything after the
subcommand is handed to it unchanged. Services are imported only when chosen, so ``pshard --help`` and
``pshard ps`` never import torch.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence

# subcommand -> (module whose main(argv) runs it, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "scheduler": ("pshard.scheduler.__main__", "run the scheduler (membership, barriers, layout)"),
    "ps": ("pshard.ps_server.__main__", "run one parameter server"),
    "worker": ("pshard.worker.__main__", "run one worker, chief or evaluator"),
    "launch": ("pshard.launcher.__main__", "run a whole local cluster as real processes"),
    "run": ("", "run the role TF_CONFIG's task.type names"),
    "health": ("pshard.common.health", "probe a service's gRPC health check"),
}

# TF_CONFIG task type -> subcommand (TensorFlow's old "master" is the chief).
_ROLE_COMMAND = {"scheduler": "scheduler", "ps": "ps", "chief": "worker", "master": "worker",
                 "worker": "worker", "evaluator": "worker"}


def _usage() -> str:
    lines = ["usage: pshard <command> [args...]", "", "pshard: a parameter server for PyTorch training.",
             "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "'pshard <command> --help' describes a command's flags."]
    return "\n".join(lines)


def _entry(command: str) -> Callable[[Sequence[str]], int]:
    module = importlib.import_module(COMMANDS[command][0])
    main: Callable[[Sequence[str]], int] = module.main
    return main


def role_command(environ: Mapping[str, str]) -> str:
    """The subcommand for TF_CONFIG's task.type; a missing or bad TF_CONFIG is a clean error."""
    raw = environ.get("TF_CONFIG")
    if not raw:
        raise SystemExit("pshard run: error: TF_CONFIG is not set; 'pshard run' starts the role its "
                         "task.type names (or use 'pshard scheduler|ps|worker')")
    try:
        task = json.loads(raw).get("task", {})
        task_type = str(task.get("type", "")).lower()
    except (ValueError, AttributeError):
        # The service's own parser names the field and the value; let it say so.
        return "worker"
    if task_type not in _ROLE_COMMAND:
        raise SystemExit(f"pshard run: error: task.type: got {task.get('type')!r}, expected one of "
                         f"{sorted(_ROLE_COMMAND)}")
    return _ROLE_COMMAND[task_type]


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
    if command == "run":
        if rest[:1] in (["-h"], ["--help"]):
            print("usage: pshard run [flags of the role's command]\n\nStarts the role that TF_CONFIG's "
                  "task.type names: scheduler -> 'pshard scheduler', ps -> 'pshard ps', chief/worker/"
                  "evaluator -> 'pshard worker'. Flags after 'run' go to that command.")
            return 0
        command = role_command(os.environ)
    return int(_entry(command)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
