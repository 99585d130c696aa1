"""Write a pod's TF_CONFIG the way Kubeflow's training operator would, for clusters without it.

    python -m pshard.common.cluster.k8s_tfconfig --job pshard --namespace NS --task-type ps --task-index 1 \\
        --replicas scheduler=1,ps=2,worker=2 --port 2222 --output /etc/pshard/tf_config.json

The plain manifests of deploy/k8s/plain/ run it as an init container: the StatefulSet's pod index
or the indexed Job's completion index is the task index. The result is byte for byte what the
operator writes for a TFJob (its genClusterSpec/genTFConfigJSONStr): compact JSON, jobs sorted by
name, lower-case role names, host names ``<job>-<role>-<i>.<namespace>.svc[.<domain>]:<port>``,
``"environment": "cloud"``, and no evaluator in the cluster (it is not part of training). So a
pod reads the same TF_CONFIG under either, and the same headless Service names resolve.

The result is parsed with `ClusterSpec` before it is written: a wrong replica count or index
fails the init container, with the field named, instead of the service.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from pshard.common.argtypes import int_range
from pshard.common.cluster.spec import ClusterSpec, exit_on_config_error
from pshard.common.errors import ClusterConfigError

DEFAULT_PORT = 2222  # the training operator's default tfjob-port


def replica_host(job: str, role: str, index: int, namespace: str, cluster_domain: str = "") -> str:
    """The host name of one replica's headless Service, as the operator names it."""
    # The operator's GenGeneralName replaces "/" in the joined name; the rest must be a DNS label.
    name = f"{job}-{role.lower()}-{index}".replace("/", "-")
    host = f"{name}.{namespace}.svc"
    return f"{host}.{cluster_domain}" if cluster_domain else host


def operator_tf_config(job: str, namespace: str, replicas: Mapping[str, int], task_type: str,
                       task_index: int, port: int = DEFAULT_PORT, cluster_domain: str = "") -> str:
    """The TF_CONFIG text the training operator writes for task (`task_type`, `task_index`)."""
    cluster = {
        role.lower(): [f"{replica_host(job, role, i, namespace, cluster_domain)}:{port}"
                       for i in range(count)]
        for role, count in replicas.items() if role.lower() != "evaluator"
    }
    config = {"cluster": dict(sorted(cluster.items())),
              "task": {"type": task_type.lower(), "index": task_index},
              "environment": "cloud"}
    # Go's json.Marshal: no spaces, map keys sorted, struct fields in declaration order.
    return json.dumps(config, separators=(",", ":"))


def parse_replicas(text: str) -> dict[str, int]:
    """``"scheduler=1,ps=2,worker=2"`` -> ``{"scheduler": 1, "ps": 2, "worker": 2}``."""
    replicas: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",")):
        role, sep, count = item.partition("=")
        if not sep or not role or not count.isdigit():
            raise ClusterConfigError(f"--replicas: got {item!r} in {text!r}, expected ROLE=COUNT")
        if role.lower() in replicas:
            raise ClusterConfigError(f"--replicas: role {role!r} given twice in {text!r}")
        replicas[role.lower()] = int(count)
    return replicas


def build(args: argparse.Namespace) -> str:
    """TF_CONFIG for the parsed flags, checked with pshard's own parser."""
    replicas = parse_replicas(args.replicas)
    text = operator_tf_config(args.job, args.namespace, replicas, args.task_type, args.task_index,
                              args.port, args.cluster_domain)
    ClusterSpec.from_tf_config(text)
    return text


def write_atomically(path: Path, text: str) -> None:
    """A restarted init container never leaves a half-written file for the service to read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _index(value: str) -> int:
    # The pod-index label and the completion-index annotation arrive as strings; "" means the
    # field reference found nothing (a Kubernetes older than the label).
    if not value.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value!r}")
    return int(value)


@exit_on_config_error(prog="python -m pshard.common.cluster.k8s_tfconfig")
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pshard.common.cluster.k8s_tfconfig",
                                description="Write TF_CONFIG as Kubeflow's training operator would.")
    p.add_argument("--job", required=True, help="job name, the first part of every host name")
    p.add_argument("--namespace", required=True, help="the pods' namespace")
    p.add_argument("--task-type", required=True, type=str.lower, help="this pod's role, e.g. ps")
    p.add_argument("--task-index", required=True, type=_index, help="this pod's index within its role")
    p.add_argument("--replicas", required=True, metavar="ROLE=N[,...]", help="replica count of every role")
    p.add_argument("--port", type=int_range(1, 65535), default=DEFAULT_PORT,
                   help=f"every role's port (default {DEFAULT_PORT})")
    p.add_argument("--cluster-domain", default="",
                   help="appended to '.svc' (the operator's CUSTOM_CLUSTER_DOMAIN; default none)")
    p.add_argument("--output", metavar="PATH", help="write here (default: stdout)")
    args = p.parse_args(argv)
    text = build(args)
    if args.output:
        write_atomically(Path(args.output), text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
