"""Cluster configuration: TF_CONFIG and command-line flags, parsed once into a frozen `ClusterSpec`.

Accepts exactly the JSON that TensorFlow and Kubeflow's TFJob write::

    {"cluster": {"chief": ["tfjob-chief-0.ns.svc:2222"], "ps": [...], "worker": [...]},
     "task": {"type": "worker", "index": 1},
     "environment": "cloud"}

plus our own ``scheduler`` role. Unknown top-level keys and unknown cluster jobs are ignored
(TensorFlow ignores them too). ``master`` is the old name of ``chief`` and is read as ``chief``.
When the cluster has no ``scheduler`` entry, the chief (else worker 0) hosts the scheduler service
in-process, at its own address.

Every error is a `ClusterConfigError` whose message names the field path and the value, e.g.
``task.index: got 2, but cluster.worker has 2 entries (valid: 0..1)``. Entry points turn it into
``<prog>: error: <message>`` and exit status 2 with `exit_on_config_error`.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar, overload

from pshard.common.argtypes import non_negative_int
from pshard.common.errors import ClusterConfigError

# Cluster jobs we read, in the order they are listed; "master" is folded into "chief".
JOBS = ("scheduler", "chief", "ps", "worker", "evaluator")
TASK_TYPES = (*JOBS, "master")

# RFC 1123 host names (Kubernetes service names such as tfjob-worker-0.ns.svc); underscores are
# tolerated because Docker Compose service names may contain them.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?$")


def parse_address(value: object, field: str) -> str:
    """Validate ``host:port`` (host name, IPv4, or ``[IPv6]``) and return it unchanged."""
    if not isinstance(value, str):
        raise ClusterConfigError(f"{field}: got {value!r}, expected a 'host:port' string")
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
        if not sep:
            raise ClusterConfigError(f"{field}: got {value!r}, expected '[ipv6]:port'")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ClusterConfigError(f"{field}: got {value!r}, {host!r} is not an IPv6 address") from None
    else:
        host, sep, port = value.rpartition(":")
        if not sep:
            raise ClusterConfigError(f"{field}: got {value!r}, the port is missing (expected 'host:port')")
        if ":" in host:
            raise ClusterConfigError(
                f"{field}: got {value!r}, an IPv6 host needs brackets: '[{host}]:{port}'")
        if not _valid_host(host):
            raise ClusterConfigError(
                f"{field}: got {value!r}, {host!r} is not a valid host name or IPv4 address")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ClusterConfigError(f"{field}: got {value!r}, port {port!r} is not in 1..65535")
    return value


def _valid_host(host: str) -> bool:
    if re.fullmatch(r"[0-9.]+", host):
        # All digits and dots must be a dotted-quad IPv4 address, not a host name.
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
        return True
    return len(host) <= 253 and _HOSTNAME.match(host) is not None


def split_address(address: str) -> tuple[str, int]:
    """``'[::1]:7000'`` -> ``('::1', 7000)``; the address must already be valid."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class ClusterSpec:
    """Who is in the cluster and which task this process is. Validated on construction."""

    task_type: str
    task_index: int
    scheduler: tuple[str, ...] = ()
    chief: tuple[str, ...] = ()
    ps: tuple[str, ...] = ()
    worker: tuple[str, ...] = ()
    evaluator: tuple[str, ...] = ()
    # A worker joining a running job (`--join`, docs/architecture.md 3 Membership): its index may
    # lie beyond cluster.worker, which still lists the workers the job started with.
    joining: bool = False

    def __post_init__(self) -> None:
        if self.task_type == "master":
            object.__setattr__(self, "task_type", "chief")
        if self.task_type not in JOBS:
            raise ClusterConfigError(f"task.type: got {self.task_type!r}, expected one of {TASK_TYPES}")
        for job in JOBS:
            for i, address in enumerate(self.job(job)):
                parse_address(address, f"cluster.{job}[{i}]")
        if len(self.scheduler) > 1:
            raise ClusterConfigError(
                f"cluster.scheduler: got {list(self.scheduler)}, expected exactly one address")
        index = self.task_index
        if not isinstance(index, int) or isinstance(index, bool):
            raise ClusterConfigError(f"task.index: got {index!r}, expected an integer")
        if index < 0:
            raise ClusterConfigError(f"task.index: got {index}, expected >= 0")
        entries = self.job(self.task_type)
        # TensorFlow's own examples leave the evaluator out of the cluster: it is not part of
        # training, it only reads checkpoints. Accept that; it then has no address of its own.
        if not entries and self.task_type != "evaluator":
            raise ClusterConfigError(
                f"task.type: got {self.task_type!r}, but cluster has no {self.task_type!r} entry "
                f"(it has {sorted(j for j in JOBS if self.job(j))})")
        if self.joining and self.task_type != "worker":
            raise ClusterConfigError(f"--join: got task.type {self.task_type!r}, only a worker can join")
        if entries and index >= len(entries) and not self.joining:
            raise ClusterConfigError(
                f"task.index: got {index}, but cluster.{self.task_type} has {len(entries)} "
                f"entr{'y' if len(entries) == 1 else 'ies'} (valid: 0..{len(entries) - 1})")
        if not (self.scheduler or self.chief or self.worker):
            raise ClusterConfigError(
                "cluster: got no 'scheduler', 'chief', 'master' or 'worker' entry; one of them must host "
                "the scheduler (or pass --scheduler HOST:PORT)")

    # ---- construction ----

    @classmethod
    def from_tf_config(cls, raw: str, joining: bool = False) -> ClusterSpec:
        """Parse the TF_CONFIG JSON text; raises ClusterConfigError naming the field and the value."""
        try:
            config = json.loads(raw)
        except (json.JSONDecodeError, TypeError) as e:
            raise ClusterConfigError(f"TF_CONFIG: not valid JSON ({e}): {_clip(raw)}") from None
        if not isinstance(config, dict):
            raise ClusterConfigError(f"TF_CONFIG: got {_clip(raw)}, expected a JSON object")
        cluster = _lower_case_jobs(_require_object(config, "cluster"))
        task = _require_object(config, "task")
        if "type" not in task:
            raise ClusterConfigError(f"task.type: missing in {_clip(json.dumps(task))}")
        if "index" not in task:
            raise ClusterConfigError(f"task.index: missing in {_clip(json.dumps(task))}")
        task_type = task["type"]
        # TensorFlow's TFConfigClusterResolver takes the type in any case ("Worker", "PS").
        if not isinstance(task_type, str) or task_type.lower() not in TASK_TYPES:
            raise ClusterConfigError(f"task.type: got {task_type!r}, expected one of {TASK_TYPES}")
        if "chief" in cluster and "master" in cluster:
            raise ClusterConfigError(
                f"cluster.master: got {cluster['master']!r} next to cluster.chief {cluster['chief']!r}; "
                "'master' is the old name of 'chief', give only one")
        jobs = {job: _job_addresses(cluster, job) for job in ("scheduler", "ps", "worker", "evaluator")}
        jobs["chief"] = _job_addresses(cluster, "master" if "master" in cluster else "chief")
        return cls(task_type=task_type.lower(), task_index=_task_index(task["index"]),
                   scheduler=jobs["scheduler"], chief=jobs["chief"], ps=jobs["ps"], worker=jobs["worker"],
                   evaluator=jobs["evaluator"], joining=joining)

    # ---- derived facts ----

    def job(self, name: str) -> tuple[str, ...]:
        """Addresses of one job ('master' reads the chief's)."""
        name = "chief" if name == "master" else name
        if name not in JOBS:
            raise ClusterConfigError(f"job: got {name!r}, expected one of {TASK_TYPES}")
        value: tuple[str, ...] = getattr(self, name)
        return value

    @property
    def node_id(self) -> str:
        """Stable node id, e.g. 'worker-1' or 'chief-0'."""
        return f"{self.task_type}-{self.task_index}"

    @property
    def own_address(self) -> str | None:
        """This task's address in the cluster (None for an evaluator left out of the cluster)."""
        entries = self.job(self.task_type)
        return entries[self.task_index] if self.task_index < len(entries) else None

    @property
    def ps_addresses(self) -> tuple[str, ...]:
        return self.ps

    @property
    def worker_ids(self) -> tuple[str, ...]:
        """Node ids of the data-parallel ranks: chief first, then the workers."""
        return (*(f"chief-{i}" for i in range(len(self.chief))),
                *(f"worker-{i}" for i in range(len(self.worker))))

    @property
    def world_size(self) -> int:
        """Number of data-parallel ranks (chief + workers)."""
        return len(self.chief) + len(self.worker)

    @property
    def data_rank(self) -> int | None:
        """This task's data-parallel rank (chief first), or None for ps/scheduler/evaluator tasks."""
        if self.task_type == "chief":
            return self.task_index
        if self.task_type == "worker":
            return len(self.chief) + self.task_index
        return None

    @property
    def scheduler_address(self) -> str:
        """The scheduler's address; without a 'scheduler' entry, the task that hosts it in-process."""
        return (self.scheduler or self.chief or self.worker)[0]

    @property
    def listen_address(self) -> str:
        """Where this task's server listens: every interface, on the port of its cluster address.

        Not the cluster host name: a Kubernetes Service name resolves to a virtual IP that is not
        an address of the pod, so listening on it would fail. An IPv6 cluster address listens on
        ``[::]``. A task that hosts the scheduler in-process does so at its own address, so this is
        the scheduler's listen address too.
        """
        address = self.own_address
        if address is None:
            raise ClusterConfigError(
                f"task.type: {self.task_type!r} has no address in the cluster to listen on")
        port = split_address(address)[1]
        return f"[::]:{port}" if address.startswith("[") else f"0.0.0.0:{port}"

    @property
    def hosts_scheduler(self) -> bool:
        """True for the scheduler task, and for the chief (or worker 0) when there is no scheduler entry."""
        if self.task_type == "scheduler":
            return True
        if self.scheduler or self.task_index != 0:
            return False
        return self.task_type == "chief" or (self.task_type == "worker" and not self.chief)


def _clip(text: object, limit: int = 200) -> str:
    s = text if isinstance(text, str) else repr(text)
    return s if len(s) <= limit else s[:limit] + "..."


def _require_object(config: Mapping[str, Any], key: str) -> dict[str, Any]:
    if key not in config:
        raise ClusterConfigError(f"{key}: missing in TF_CONFIG (it has keys {sorted(config)})")
    value = config[key]
    if not isinstance(value, dict):
        raise ClusterConfigError(f"{key}: got {_clip(json.dumps(value))}, expected a JSON object")
    return value


def _lower_case_jobs(cluster: Mapping[str, Any]) -> dict[str, Any]:
    """Job names folded to lower case, as task types are; two spellings of one job are an error."""
    folded: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for name, value in cluster.items():
        job = name.lower()
        if job in folded:
            raise ClusterConfigError(
                f"cluster.{name}: got {_clip(json.dumps(value))} next to cluster.{spelled[job]}; "
                "job names are read in any case, give each job once")
        folded[job], spelled[job] = value, name
    return folded


def _task_index(value: object) -> Any:
    """task.index as TensorFlow reads it (``int(task['index'])``): ``1`` or ``"1"``.

    Anything else (1.5, true, "one") is left for ClusterSpec to refuse, naming the value, rather
    than truncated the way TensorFlow's ``int()`` would.
    """
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        return int(value.strip())
    return value


def _job_addresses(cluster: Mapping[str, Any], job: str) -> tuple[str, ...]:
    value = cluster.get(job, [])
    if isinstance(value, dict):
        # TensorFlow's sparse form {"1": "host:port"} (TFJob's enableDynamicWorker). Ranks need
        # every entry, so only a complete map 0..n-1 is accepted.
        try:
            by_index = {int(k): v for k, v in value.items()}
        except ValueError:
            raise ClusterConfigError(
                f"cluster.{job}: got {_clip(json.dumps(value))}, expected integer task indices as keys"
            ) from None
        if sorted(by_index) != list(range(len(by_index))):
            raise ClusterConfigError(
                f"cluster.{job}: got indices {sorted(by_index)}, expected every index 0..{len(by_index) - 1} "
                "(a sparse cluster without all peers is not supported)")
        value = [by_index[i] for i in range(len(by_index))]
    if not isinstance(value, list):
        raise ClusterConfigError(
            f"cluster.{job}: got {_clip(json.dumps(value))}, expected a list of 'host:port'")
    return tuple(parse_address(a, f"cluster.{job}[{i}]") for i, a in enumerate(value))


# ---- command-line flags ----

_ADDRESS_FLAGS = ("scheduler", "chief", "ps", "worker", "evaluator")


def _address_list(flag: str) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = [a.strip() for a in text.split(",") if a.strip()]
        try:
            return tuple(parse_address(a, flag) for a in items)
        except ClusterConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "HOST:PORT list"
    return parse


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster flags every entry point shares. Each overrides the same field of TF_CONFIG."""
    group = parser.add_argument_group(
        "cluster", "Which cluster this process belongs to and which task it is. TF_CONFIG (the JSON "
        "TensorFlow and Kubeflow's TFJob write) is read first; each flag below overrides its field.")
    group.add_argument("--tf-config", metavar="JSON", default=None,
                       help="cluster and task as TF_CONFIG JSON (default: the TF_CONFIG environment "
                            "variable)")
    group.add_argument("--task-type", metavar="TYPE", type=str.lower, choices=TASK_TYPES, default=None,
                       help=f"this process's role, overrides task.type; one of {', '.join(TASK_TYPES)} "
                            "('master' is read as 'chief')")
    group.add_argument("--task-index", metavar="N", type=non_negative_int, default=None,
                       help="index of this task within its role, overrides task.index (default 0 when "
                            "there is no TF_CONFIG)")
    group.add_argument("--scheduler", metavar="HOST:PORT", type=_address_list("--scheduler"), default=None,
                       help="scheduler address, overrides cluster.scheduler (without one, the chief or "
                            "worker 0 hosts the scheduler)")
    group.add_argument("--chief", metavar="HOST:PORT", type=_address_list("--chief"), default=None,
                       help="chief address, overrides cluster.chief (and cluster.master)")
    group.add_argument("--ps", metavar="HOST:PORT[,...]", type=_address_list("--ps"), default=None,
                       help="parameter-server addresses in rank order, overrides cluster.ps")
    group.add_argument("--worker", metavar="HOST:PORT[,...]", type=_address_list("--worker"), default=None,
                       help="worker addresses in rank order, overrides cluster.worker")
    group.add_argument("--evaluator", metavar="HOST:PORT", type=_address_list("--evaluator"), default=None,
                       help="evaluator address, overrides cluster.evaluator")


def cluster_config_given(args: argparse.Namespace, environ: Mapping[str, str]) -> bool:
    """Whether TF_CONFIG or any cluster flag was given (a standalone scheduler needs neither)."""
    if args.tf_config is not None or environ.get("TF_CONFIG"):
        return True
    return any(getattr(args, name, None) is not None for name in ("task_type", "task_index", *_ADDRESS_FLAGS))


def cluster_spec_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
                           default_task_type: str | None = None) -> ClusterSpec:
    """TF_CONFIG (``--tf-config`` or ``environ['TF_CONFIG']``) with the flags laid over it.

    `default_task_type` names the role when neither TF_CONFIG nor ``--task-type`` does (an entry
    point that can only be one role passes it).
    """
    environ = os.environ if environ is None else environ
    raw = args.tf_config if args.tf_config is not None else environ.get("TF_CONFIG") or None
    overrides: dict[str, Any] = {name: getattr(args, name) for name in _ADDRESS_FLAGS
                                 if getattr(args, name, None) is not None}
    if args.task_type is not None:
        overrides["task_type"] = args.task_type
    if args.task_index is not None:
        overrides["task_index"] = args.task_index
    if getattr(args, "join", False):  # only `pshard worker` has --join
        overrides["joining"] = True
    if raw is not None:
        spec = ClusterSpec.from_tf_config(raw, joining=overrides.get("joining", False))
        return replace(spec, **overrides) if overrides else spec
    overrides.setdefault("task_type", default_task_type)
    if overrides["task_type"] is None:
        raise ClusterConfigError(
            "task.type: no TF_CONFIG and no --task-type; set TF_CONFIG or pass --task-type and the "
            "cluster's addresses (--scheduler, --ps, --worker)")
    overrides.setdefault("task_index", 0)
    known = {f.name for f in fields(ClusterSpec)}
    return ClusterSpec(**{k: v for k, v in overrides.items() if k in known})


# ---- entry points ----

F = TypeVar("F", bound=Callable[..., Any])


@overload
def exit_on_config_error(fn: F) -> F: ...
@overload
def exit_on_config_error(fn: None = None, *, prog: str | None = None) -> Callable[[F], F]: ...


def exit_on_config_error(fn: F | None = None, *, prog: str | None = None) -> F | Callable[[F], F]:
    """Decorate an entry point: a ClusterConfigError prints ``<prog>: error: <message>`` and exits 2.

    Use as ``@exit_on_config_error`` or ``@exit_on_config_error(prog="python -m pshard.scheduler")``.
    A ``prog`` keyword given to the call (``main(argv, prog="pshard scheduler")``, as the pshard
    command does) wins over the decorator's; the last resort is argparse's (the script's base name).
    Exit status 2 matches argparse's usage errors: the process never started, nothing to retry.
    """

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*a: Any, **kw: Any) -> Any:
            try:
                return func(*a, **kw)
            except ClusterConfigError as e:
                name = kw.get("prog") or prog or os.path.basename(sys.argv[0]) or "pshard"
                print(f"{name}: error: {e}", file=sys.stderr)
                raise SystemExit(2) from None

        return wrapper  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate

