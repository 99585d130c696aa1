"""deploy/k8s/: validated offline, and every pod run as a local process that trains to completion.

Offline (seconds): `kubernetes-validate --strict` checks every built-in kind, and every TFJob pod
template as a Kubernetes PodTemplate; the TFJob itself is checked with jsonschema against the
training operator's v1 schema (deploy/k8s/schemas/), plus the operator's webhook rules. Every
pod's TF_CONFIG, as the operator writes it for the TFJob (emulated here from its genClusterSpec)
and as the init step writes it for the plain manifests (run for real), parses with ClusterSpec,
and its host names are the Services' names.

End to end: there is no cluster here, so each pod runs as local processes, its init containers
first, with its own command, args and env, resolved as the kubelet would (`$(VAR)` expansion,
field references). The rewrites are what the cluster would have provided, as in
test_compose_local.py: host names become 127.0.0.1 and each address a free port (every pod uses
2222 in the manifests); a volume's mount path becomes a directory per volume; `pshard` and
`python` are this environment's; PSHARD_DATA_DIR (set by the worker image) is an empty directory,
so workers train on digits; workers and chief get a --max-steps cap. Probes are run against the
pod's rewritten address; the job finishes as the operator would end it (the chief, or every
worker, exits 0), then the servers get SIGTERM as their pods' deletion sends it.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import torch
import yaml
from pshard.common.cluster.k8s_tfconfig import main as tfconfig_main
from pshard.common.cluster.k8s_tfconfig import operator_tf_config
from pshard.common.cluster.spec import ClusterSpec
from pshard.common.metrics_flag import METRICS_PORT_ENV
from pshard.ps_server.__main__ import build_parser as ps_parser
from pshard.scheduler.__main__ import build_parser as scheduler_parser
from pshard.worker.__main__ import build_parser as worker_parser

from pshard.certs import main as certs_main
from pshard.drain_cli import build_parser as drain_parser
from tests.e2e.harness import (
    FINISH_TIMEOUT_S,
    PYTHON,
    ROOT,
    STARTUP_TIMEOUT_S,
    Proc,
    Procs,
    free_ports,
    wait_until,
)
from tests.service.test_metrics_endpoints import scrape, value

K8S = ROOT / "deploy" / "k8s"
TFJOB = K8S / "tfjob" / "tfjob.yaml"
TFJOB_GPU = K8S / "tfjob" / "tfjob-gpu.yaml"
TFJOB_SCHEMA = K8S / "schemas" / "kubeflow.org_tfjobs_v1.yaml"
PLAIN = K8S / "plain"
REPLICATED = K8S / "replicated"  # the plain manifests for a job with --replicas 1 (issue 20)
# The oldest release the manifests are for: they need gRPC probes (GA in 1.27) and the StatefulSet
# pod-index label (1.28), and 1.28's schema still requires onPodConditions in every podFailurePolicy
# rule. The newest schema the validator ships is checked too, for removed or renamed fields.
K8S_VERSION = "1.29.0"
K8S_VERSIONS = (K8S_VERSION, kubernetes_validate.latest_version())
NAMESPACE = "ml"
_BIN = Path(PYTHON).parent
_PSHARD = [str(_BIN / "pshard")] if (_BIN / "pshard").is_file() else [PYTHON, "-m", "pshard"]
LOCAL_PROGRAMS = {"python": [PYTHON], "pshard": _PSHARD}
MAX_STEPS = "20"
TRAINERS = ("chief", "worker")
# Mutual TLS: one Secret per job holding `pshard certs`' files (all but the CA's key), mounted in
# every pod; each pod names its own certificate with PSHARD_TLS_*. The kubelet's gRPC probe cannot
# present a certificate, so probes run `pshard health` in the pod, on localhost (pods --bind 0.0.0.0).
TLS_DIR = "/etc/pshard/tls"
TLS_VOLUME = {"name": "tls", "secret": {"secretName": "pshard-tls", "defaultMode": 0o440}}
HEALTH_PROBE = ["pshard", "health", "localhost:2222"]


def load(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if "schemas" not in p.parts)


def plain_docs() -> list[dict[str, Any]]:
    return [doc for path in sorted(PLAIN.glob("*.yaml")) for doc in load(path)]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


# ---- pods, as the controllers would create them ----

@dataclass
class Pod:
    name: str
    role: str
    index: int
    spec: dict[str, Any]
    labels: dict[str, str]
    annotations: dict[str, str] = field(default_factory=dict)
    # TF_CONFIG the operator injects into the container named "tensorflow" (TFJob pods only).
    tf_config: str | None = None
    # volume name -> volumeClaimTemplate (StatefulSet pods only)
    claim_templates: tuple[str, ...] = ()


def tfjob_pods(tfjob: dict[str, Any]) -> list[Pod]:
    """The pods the training operator creates for a TFJob, each with the TF_CONFIG it writes."""
    job = tfjob["metadata"]["name"]
    specs = tfjob["spec"]["tfReplicaSpecs"]
    ports = {rtype: operator_port(spec) for rtype, spec in specs.items()}
    pods = []
    for rtype, spec in specs.items():
        for i in range(spec.get("replicas", 1)):
            role = rtype.lower()
            labels = {**spec["template"]["metadata"].get("labels", {}),
                      "training.kubeflow.org/job-name": job,
                      "training.kubeflow.org/replica-type": role,
                      "training.kubeflow.org/replica-index": str(i)}
            pods.append(Pod(f"{job}-{role}-{i}", role, i, copy.deepcopy(spec["template"]["spec"]), labels,
                            dict(spec["template"]["metadata"].get("annotations", {})),
                            tf_config=emulated_operator_tf_config(job, specs, ports, rtype, i)))
    return pods


def operator_port(replica_spec: dict[str, Any]) -> int:
    """The operator's GetPortFromTFJob: container "tensorflow", port "tfjob-port" (default 2222)."""
    for container in replica_spec["template"]["spec"]["containers"]:
        if container["name"] == "tensorflow":
            for port in container.get("ports", []):
                if port.get("name") == "tfjob-port":
                    return int(port["containerPort"])
    return 2222


def emulated_operator_tf_config(job: str, specs: dict[str, Any], ports: dict[str, int], rtype: str,
                                index: int) -> str:
    """genTFConfigJSONStr, transcribed: written apart from common/cluster/k8s_tfconfig.py to check it."""
    cluster = {}
    for other, spec in specs.items():
        if other == "Evaluator":  # "evaluator is not part of training cluster"
            continue
        rt = other.lower()
        cluster[rt] = [f"{job}-{rt}-{i}.{NAMESPACE}.svc:{ports[other]}"
                       for i in range(spec.get("replicas", 1))]
    config = {"cluster": {k: cluster[k] for k in sorted(cluster)},  # Go marshals map keys sorted
              "task": {"type": rtype.lower(), "index": index}, "environment": "cloud"}
    return json.dumps(config, separators=(",", ":"))


def plain_pods(docs: list[dict[str, Any]]) -> list[Pod]:
    """The pods the StatefulSet and Job controllers create, with the labels they add."""
    pods = []
    for name, sts in by_kind(docs, "StatefulSet").items():
        template = sts["spec"]["template"]
        for i in range(sts["spec"]["replicas"]):
            labels = {**template["metadata"]["labels"], "statefulset.kubernetes.io/pod-name": f"{name}-{i}",
                      "apps.kubernetes.io/pod-index": str(i)}
            pods.append(Pod(f"{name}-{i}", labels["app.kubernetes.io/component"], i,
                            copy.deepcopy(template["spec"]), labels,
                            dict(template["metadata"].get("annotations", {})),
                            claim_templates=tuple(t["metadata"]["name"]
                                                  for t in sts["spec"].get("volumeClaimTemplates", []))))
    for name, job in by_kind(docs, "Job").items():
        template = job["spec"]["template"]
        assert job["spec"]["completionMode"] == "Indexed"
        for i in range(job["spec"]["completions"]):
            index = {"batch.kubernetes.io/job-completion-index": str(i)}
            spec = copy.deepcopy(template["spec"])
            # The Job controller gives every container, init containers too, the index as env.
            for c in [*spec.get("initContainers", []), *spec["containers"]]:
                c.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "value": str(i)})
            role = template["metadata"]["labels"]["app.kubernetes.io/component"]
            pods.append(Pod(f"{name}-{i}-x7k2p", role, i, spec, {**template["metadata"]["labels"], **index},
                            {**template["metadata"].get("annotations", {}), **index}))
    return pods


def container_env(pod: Pod, container: dict[str, Any]) -> dict[str, str]:
    """The container's declared env, field references resolved as the kubelet resolves them."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        path = var["valueFrom"]["fieldRef"]["fieldPath"]
        if path == "metadata.name":
            env[var["name"]] = pod.name
        elif path == "metadata.namespace":
            env[var["name"]] = NAMESPACE
        elif m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path):
            source = pod.labels if m.group(1) == "labels" else pod.annotations
            assert m.group(2) in source, f"{pod.name}: {path} is not set on the pod"
            env[var["name"]] = source[m.group(2)]
        else:
            raise AssertionError(f"{pod.name}: field reference {path!r} is not emulated here")
    if pod.tf_config is not None and container["name"] == "tensorflow":
        env["TF_CONFIG"] = pod.tf_config
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: $$ is a literal $, an unknown $(NAME) stays as written."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, text)


def argv_of(pod: Pod, container: dict[str, Any]) -> list[str]:
    env = container_env(pod, container)
    return [expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]


# ---- offline validation ----

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_built_in_kind_validates_strictly(version: str) -> None:
    builtin = [p for p in manifest_files() if all(d["kind"] != "TFJob" for d in load(p))]
    assert {p.name for p in builtin} >= {"checkpoints-pvc.yaml", "services.yaml", "scheduler.yaml",
                                         "servers.yaml", "workers.yaml", "networkpolicy.yaml"}
    result = subprocess.run([str(_BIN / "kubernetes-validate"), "--strict", "-k", version, "--quiet",
                             *map(str, builtin)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    # The validator does catch a misspelt field (and would catch it in a TFJob's pod template).
    pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
                    "template": {"spec": {"containers": [{"name": "c", "image": "i", "comand": ["x"]}]}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod_template, version, strict=True)


@pytest.mark.parametrize("path", [TFJOB, TFJOB_GPU], ids=lambda p: p.name)
def test_tfjob_matches_the_operators_v1_api(path: Path) -> None:
    (tfjob,) = load(path)
    schema = yaml.safe_load(TFJOB_SCHEMA.read_text(encoding="utf-8"))["openAPIV3Schema"]
    jsonschema.validate(tfjob, schema)
    specs = tfjob["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"Chief", "Worker", "PS", "Evaluator"}
    assert {rtype: s["restartPolicy"] for rtype, s in specs.items()} == {
        "Chief": "OnFailure", "PS": "OnFailure", "Worker": "ExitCode", "Evaluator": "OnFailure"}
    assert specs["Chief"]["replicas"] == 1  # the webhook refuses more than one chief
    images = set()
    for rtype, spec in specs.items():
        # Each pod template is a valid PodTemplateSpec, checked as strictly as the built-in kinds.
        as_pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": rtype.lower()},
                           "template": spec["template"]}
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(as_pod_template, version, strict=True)
        (container,) = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "tensorflow"]
        assert container["command"] == ["pshard", "run"], rtype
        assert {"name": "tfjob-port", "containerPort": 2222} in container["ports"], rtype
        images.add(container["image"])
        annotations = spec["template"]["metadata"].get("annotations", {})
        if rtype != "Evaluator":  # which serves no metrics (test_every_pshard_container_serves_metrics...)
            assert annotations["prometheus.io/scrape"] == "true"
            assert int(annotations["prometheus.io/port"]) in {p["containerPort"] for p in container["ports"]}
        tls = [v for v in spec["template"]["spec"]["volumes"] if v["name"] == "tls"]
        assert tls == [TLS_VOLUME], rtype  # not optional: no pod runs without its certificate
        if rtype in ("Chief", "PS"):  # the pods that serve gRPC: chief (scheduler) and servers
            for kind in ("readinessProbe", "livenessProbe"):
                assert container[kind]["exec"] == {"command": HEALTH_PROBE}, (rtype, kind)
        assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert len(images) == 1, images
    (ps,) = [c for c in specs["PS"]["template"]["spec"]["containers"]]
    assert "/checkpoints/$(POD_NAME)" in ps["args"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "pshard-checkpoints"}} in \
        specs["PS"]["template"]["spec"]["volumes"]


@pytest.mark.parametrize("mutate", [
    lambda j: j["spec"]["tfReplicaSpecs"]["Worker"].update(restartPolicy="Sometimes"),
    lambda j: j["spec"]["tfReplicaSpecs"].update(Scheduler=j["spec"]["tfReplicaSpecs"]["PS"]),
    lambda j: j["spec"]["runPolicy"].update(cleanPodPolicy="Some"),
    lambda j: j["spec"]["tfReplicaSpecs"]["PS"].update(replica=2),
], ids=["restart-policy", "replica-type", "clean-pod-policy", "misspelt-field"])
def test_the_tfjob_schema_refuses_what_the_operator_refuses(mutate: Any) -> None:
    (tfjob,) = load(TFJOB)
    schema = yaml.safe_load(TFJOB_SCHEMA.read_text(encoding="utf-8"))["openAPIV3Schema"]
    mutate(tfjob)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(tfjob, schema)


def gpu_variant(tfjob: dict[str, Any]) -> dict[str, Any]:
    """tfjob.yaml with exactly the changes tfjob-gpu.yaml's header lists."""
    gpu = copy.deepcopy(tfjob)
    for rtype, spec in gpu["spec"]["tfReplicaSpecs"].items():
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        container["image"] = "pshard-worker:cuda"
        if rtype in ("Chief", "Worker"):
            at = container["args"].index("--epochs") + 2
            container["args"][at:at] = ["--device", "cuda"]
            container["resources"]["limits"]["nvidia.com/gpu"] = 1
            pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return gpu


def test_the_gpu_tfjob_is_the_cpu_one_with_gpus_for_the_trainers() -> None:
    (cpu,), (gpu,) = load(TFJOB), load(TFJOB_GPU)
    assert gpu == gpu_variant(cpu)


def test_every_tfjob_pod_reads_its_tf_config_as_the_operator_writes_it() -> None:
    (tfjob,) = load(TFJOB)
    pods = {p.name: p for p in tfjob_pods(tfjob)}
    assert sorted(pods) == ["pshard-chief-0", "pshard-evaluator-0", "pshard-ps-0", "pshard-ps-1",
                            "pshard-worker-0", "pshard-worker-1"]
    assert pods["pshard-ps-1"].tf_config == (
        '{"cluster":{"chief":["pshard-chief-0.ml.svc:2222"],"ps":["pshard-ps-0.ml.svc:2222",'
        '"pshard-ps-1.ml.svc:2222"],"worker":["pshard-worker-0.ml.svc:2222","pshard-worker-1.ml.svc:2222"]},'
        '"task":{"type":"ps","index":1},"environment":"cloud"}')
    for pod in pods.values():
        assert pod.tf_config is not None
        spec = ClusterSpec.from_tf_config(pod.tf_config)
        assert (spec.task_type, spec.task_index) == (pod.role, pod.index)
        # The chief hosts the scheduler; everyone finds it at the chief's address.
        assert spec.scheduler_address == "pshard-chief-0.ml.svc:2222"
        assert spec.hosts_scheduler == (pod.role == "chief")
        assert spec.worker_ids == ("chief-0", "worker-0", "worker-1")
        # common/cluster/k8s_tfconfig.py writes the same bytes for the same replicas.
        replicas = {r: s["replicas"] for r, s in tfjob["spec"]["tfReplicaSpecs"].items()}
        assert operator_tf_config("pshard", NAMESPACE, replicas, pod.role, pod.index) == pod.tf_config
    assert ClusterSpec.from_tf_config(pods["pshard-evaluator-0"].tf_config or "").own_address is None


def run_init_steps(pods: list[Pod], tmp_path: Path) -> dict[str, str]:
    """Each pod's init container, run in-process with its own argv; pod name -> TF_CONFIG written."""
    written = {}
    for pod in pods:
        (init,) = pod.spec["initContainers"]
        argv = argv_of(pod, init)
        assert argv[:3] == ["python", "-m", "pshard.common.cluster.k8s_tfconfig"], argv
        (mount,) = init["volumeMounts"]
        out = argv.index("--output") + 1
        target = Path(argv[out])
        assert target.parent == Path(mount["mountPath"]), (pod.name, target)
        argv[out] = str(tmp_path / pod.name / target.name)
        assert tfconfig_main(argv[3:]) == 0
        written[pod.name] = Path(argv[out]).read_text(encoding="utf-8")
    return written


def test_the_init_step_writes_the_operators_tf_config_with_resolvable_names(tmp_path: Path) -> None:
    docs = plain_docs()
    pods = plain_pods(docs)
    assert sorted(p.name for p in pods) == ["pshard-ps-0", "pshard-ps-1", "pshard-scheduler-0",
                                            "pshard-worker-0-x7k2p", "pshard-worker-1-x7k2p"]
    counts = {"scheduler": 1, "ps": 2, "worker": 2}
    written = run_init_steps(pods, tmp_path)
    services = by_kind(docs, "Service")
    for pod in pods:
        # The replica counts every init step names are the controllers' replica counts.
        (init,) = pod.spec["initContainers"]
        assert f"scheduler=1,ps={counts['ps']},worker={counts['worker']}" in init["command"]
        tf_config = written[pod.name]
        assert tf_config == operator_tf_config("pshard", NAMESPACE, counts, pod.role, pod.index)
        spec = ClusterSpec.from_tf_config(tf_config)
        assert (spec.task_type, spec.task_index) == (pod.role, pod.index)
    sts, jobs = by_kind(docs, "StatefulSet"), by_kind(docs, "Job")
    assert sts["pshard-ps"]["spec"]["replicas"] == counts["ps"]
    assert sts["pshard-scheduler"]["spec"]["replicas"] == counts["scheduler"]
    assert jobs["pshard-worker"]["spec"]["completions"] == jobs["pshard-worker"]["spec"]["parallelism"] == 2
    # Every address someone connects to (scheduler, servers) is a headless Service selecting
    # exactly that pod, on the port its container serves.
    spec = ClusterSpec.from_tf_config(written["pshard-scheduler-0"])
    by_name = {p.name: p for p in pods}
    for address in [*spec.scheduler, *spec.ps]:
        host, port = address.rsplit(":", 1)
        service_name, namespace, svc = host.split(".")
        assert (namespace, svc) == (NAMESPACE, "svc")
        service = services[service_name]["spec"]
        assert service["clusterIP"] == "None"
        selected = [p for p in pods if service["selector"].items() <= p.labels.items()]
        assert [p.name for p in selected] == [service_name], address
        (container,) = by_name[service_name].spec["containers"]
        assert {"name": "grpc", "containerPort": int(port)} in container["ports"]
        assert service["ports"] == [{"name": "grpc", "port": int(port), "targetPort": "grpc"}]
    # Each StatefulSet's governing Service and the Job's subdomain exist and are headless.
    for governing in [*(s["spec"]["serviceName"] for s in sts.values()),
                      jobs["pshard-worker"]["spec"]["template"]["spec"]["subdomain"]]:
        assert services[governing]["spec"]["clusterIP"] == "None"


def test_the_plain_manifests_probe_budget_and_fence_the_job() -> None:
    docs = plain_docs()
    pods = plain_pods(docs)
    for pod in pods:
        (container,) = pod.spec["containers"]
        assert container["resources"]["requests"].keys() >= {"cpu", "memory"}, pod.name
        assert pod.annotations["prometheus.io/scrape"] == "true"
        if pod.role in ("scheduler", "ps"):
            assert container["readinessProbe"]["exec"] == {"command": HEALTH_PROBE}
            assert container["livenessProbe"]["exec"] == {"command": HEALTH_PROBE}
    (pdb,) = by_kind(docs, "PodDisruptionBudget").values()
    covered = [p.name for p in pods if pdb["spec"]["selector"]["matchLabels"].items() <= p.labels.items()]
    assert covered == ["pshard-ps-0", "pshard-ps-1"]
    (policy,) = by_kind(docs, "NetworkPolicy").values()
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert all(selector.items() <= p.labels.items() for p in pods)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    # Only the job's own pods, from this namespace, and nothing else.
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": selector}}]}]


def test_the_replicated_variant_drains_each_server_the_statefulset_scales_down(tmp_path: Path) -> None:
    """deploy/k8s/replicated/ (issue 20): servers with --replicas 1 --drain-on-term, a preStop hook that
    drains the pod's own server (run here for real, with a stand-in `pshard` that records what it got), and a
    grace period that outlasts both drains; workers with --replicas 1; a scheduler planning row partitions
    that can move one by one. The rest is the plain manifests' (links), and the existing validation test
    checks every file strictly."""
    files = {p.name for p in REPLICATED.glob("*.yaml")}
    assert files == {p.name for p in PLAIN.glob("*.yaml")} and files <= {p.name for p in manifest_files()}
    for name in files - {"servers.yaml", "workers.yaml", "scheduler.yaml"}:
        assert (REPLICATED / name).resolve() == (PLAIN / name).resolve()
    docs = [doc for path in sorted(REPLICATED.glob("*.yaml")) for doc in load(path)]
    # A scale-down removes one server at a time, so two never drain into each other.
    assert by_kind(docs, "StatefulSet")["pshard-ps"]["spec"]["podManagementPolicy"] == "OrderedReady"
    pods = plain_pods(docs)
    shim = tmp_path / "bin" / "pshard"
    shim.parent.mkdir()
    shim.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$OUT"\nprintf "%s" "$TF_CONFIG" > "$OUT.tf"\n')
    shim.chmod(0o755)
    tf_config = tmp_path / "tf_config.json"
    tf_config.write_text('{"cluster": {}, "task": {"type": "ps", "index": 1}}')
    drained = []
    for pod in pods:
        (container,) = pod.spec["containers"]
        args = argv_of(pod, container)[4:]  # sh -c SCRIPT pshard ARGS...
        if pod.role == "scheduler":
            assert scheduler_parser().parse_args(args).row_partitions_per_server == 4
            continue
        if pod.role != "ps":
            assert worker_parser({}).parse_args(args).replicas == 1, pod.name
            continue
        ps = ps_parser().parse_args(args)
        assert (ps.replicas, ps.drain_on_term, ps.drain_timeout_s) == (1, True, 60.0)
        sh, dash_c, script = container["lifecycle"]["preStop"]["exec"]["command"]
        env = container_env(pod, container)
        assert (sh, dash_c) == ("sh", "-c") and expand(script, env) == script  # the same, expanded or not
        out = tmp_path / f"{pod.name}.args"
        subprocess.run([sh, dash_c, script.replace("/etc/pshard/tf-config/tf_config.json", str(tf_config))],
                       env={**env, "PATH": f"{shim.parent}:/usr/bin:/bin", "OUT": str(out)}, check=True,
                       timeout=30)
        hook = out.read_text().split()
        assert hook[0] == "drain" and Path(f"{out}.tf").read_text() == tf_config.read_text()
        drain = drain_parser().parse_args(hook[1:])
        assert drain.server == f"ps-{pod.index}" and drain.scheduler is None  # TF_CONFIG's scheduler
        assert pod.spec["terminationGracePeriodSeconds"] > drain.timeout_s + ps.drain_timeout_s + 10
        drained.append(pod.name)
    assert drained == ["pshard-ps-0", "pshard-ps-1"]


def test_the_init_step_names_the_field_it_cannot_build(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--job", "pshard", "--namespace", NAMESPACE, "--task-type", "ps",
            "--replicas", "scheduler=1,ps=2"]
    with pytest.raises(SystemExit) as exc:
        tfconfig_main([*base, "--task-index", "2", "--output", str(tmp_path / "tf_config.json")])
    assert exc.value.code == 2
    assert "task.index: got 2, but cluster.ps has 2 entries" in capsys.readouterr().err
    assert not (tmp_path / "tf_config.json").exists()
    with pytest.raises(SystemExit):  # an unset pod-index label arrives as ""
        tfconfig_main([*base, "--task-index", ""])
    assert "--task-index" in capsys.readouterr().err


# Roles whose service serves /metrics with --metrics-port; an evaluator takes the flag and serves nothing.
METRICS_ROLES = {"scheduler", "ps", "chief", "worker"}


def metrics_flag(pod: Pod, container: dict[str, Any]) -> int | None:
    """--metrics-port as the role's own command parses the container's args (None: not given)."""
    env = container_env(pod, container)
    args = [expand(a, env) for a in container.get("args", [])]
    parser = {"scheduler": scheduler_parser(), "ps": ps_parser()}.get(pod.role) or worker_parser({})
    port: int | None = parser.parse_args(args).metrics_port
    return port


@pytest.mark.parametrize("pods", [
    pytest.param(lambda: tfjob_pods(load(TFJOB)[0]), id="tfjob"),
    pytest.param(lambda: tfjob_pods(load(TFJOB_GPU)[0]), id="tfjob-gpu"),
    pytest.param(lambda: plain_pods(plain_docs()), id="plain"),
])
def test_every_pshard_container_serves_metrics_on_the_port_its_pod_announces(
        pods: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(METRICS_PORT_ENV, raising=False)  # the flag's default: only the args count
    roles = set()
    for pod in pods():
        (container,) = pod.spec["containers"]
        flag = metrics_flag(pod, container)
        named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == "metrics"]
        scrape = {k: v for k, v in pod.annotations.items() if k.startswith("prometheus.io/")}
        roles.add(pod.role)
        if pod.role not in METRICS_ROLES:
            assert (flag, named, scrape) == (None, [], {}), pod.name  # nothing announced that nobody serves
            continue
        assert flag is not None and flag > 0, f"{pod.name}: no --metrics-port in {container.get('args')}"
        assert named == [flag], (pod.name, container.get("ports"))
        assert scrape == {"prometheus.io/scrape": "true", "prometheus.io/port": str(flag)}, pod.name
        other = [p["containerPort"] for p in container.get("ports", []) if p.get("name") != "metrics"]
        assert flag not in other, pod.name
    assert roles >= {"ps", "worker"}


@pytest.mark.parametrize("pods", [
    pytest.param(lambda: tfjob_pods(load(TFJOB)[0]), id="tfjob"),
    pytest.param(lambda: tfjob_pods(load(TFJOB_GPU)[0]), id="tfjob-gpu"),
    pytest.param(lambda: plain_pods(plain_docs()), id="plain"),
])
def test_every_pod_names_its_own_certificate_and_serving_pods_probe_with_it(pods: Any) -> None:
    for pod in pods():
        (container,) = pod.spec["containers"]
        env = container_env(pod, container)
        node = f"{pod.role}-{pod.index}"  # the node id TF_CONFIG gives it, the name `pshard certs` uses
        assert {k: v for k, v in env.items() if k.startswith("PSHARD_TLS_")} == {
            "PSHARD_TLS_CERT": f"{TLS_DIR}/{node}.pem", "PSHARD_TLS_KEY": f"{TLS_DIR}/{node}-key.pem",
            "PSHARD_TLS_CA": f"{TLS_DIR}/ca.pem", "PSHARD_TLS_CRL": f"{TLS_DIR}/crl.pem"}, pod.name
        assert "PSHARD_INSECURE" not in env and "--insecure" not in argv_of(pod, container), pod.name
        assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in container["volumeMounts"], pod.name
        assert TLS_VOLUME in pod.spec["volumes"], pod.name
        assert pod.spec["securityContext"]["fsGroup"] == 10001, pod.name  # the group of the 0440 keys
        serves = "readinessProbe" in container
        assert serves == (pod.role in ("chief", "ps", "scheduler")), pod.name
        if serves:  # the probe dials localhost: the service listens on every interface of the pod
            argv = argv_of(pod, container)
            assert argv[argv.index("--bind") + 1] == "0.0.0.0:2222", pod.name


# ---- end to end: every pod as local processes ----

class LocalPods:
    """Runs pods as local processes; see the module docstring for the rewrites."""

    def __init__(self, procs: Procs, pods: list[Pod], tmp_path: Path) -> None:
        self.procs = procs
        self.pods = {p.name: p for p in pods}
        self.tmp_path = tmp_path
        self.data_dir = tmp_path / "empty-data"
        self.data_dir.mkdir()
        self.address_map: dict[str, str] = {}

    def map_addresses(self, tf_configs: list[str]) -> None:
        addresses = sorted({a for t in tf_configs for job in json.loads(t)["cluster"].values() for a in job})
        self.address_map = {a: f"127.0.0.1:{p}"
                            for a, p in zip(addresses, free_ports(len(addresses)), strict=True)}

    def rewrite_tf_config(self, text: str) -> str:
        config = json.loads(text)
        config["cluster"] = {job: [self.address_map[a] for a in addresses]
                             for job, addresses in config["cluster"].items()}
        return json.dumps(config)

    def own_port(self, pod: Pod, tf_config: str) -> int:
        task = json.loads(tf_config)["task"]
        original = json.loads(tf_config)["cluster"][task["type"]][task["index"]]
        return int(self.address_map[original].rsplit(":", 1)[1])

    def volume_dir(self, pod: Pod, name: str) -> Path:
        """A shared claim, or a Secret, is one directory for every pod; anything else is the pod's own."""
        (volume,) = [v for v in pod.spec.get("volumes", []) if v["name"] == name] or [{"name": name}]
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        secret = (volume.get("secret") or {}).get("secretName")
        path = (self.tmp_path / "volumes" / claim if claim else self.tmp_path / "secrets" / secret if secret
                else self.tmp_path / "pods" / pod.name / name)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def make_tls_secret(self, pods: list[Pod]) -> Path:
        """The pshard-tls Secret as docs/operations/kubernetes.md makes it: `pshard certs` for every pod's
        node (hosts: the namespace's service names), then every file but the CA's key."""
        made = self.tmp_path / "pshard-certs"
        nodes = [f"{p.role}/{p.role}-{p.index}" for p in pods]
        assert certs_main(["--dir", str(made), "--host", f"*.{NAMESPACE}.svc", *nodes]) == 0
        (tls_volume,) = {v["secret"]["secretName"] for p in pods for v in p.spec["volumes"] if "secret" in v}
        secret = self.tmp_path / "secrets" / tls_volume
        secret.mkdir(parents=True)
        for path in made.glob("*.pem"):
            if path.name != "ca-key.pem":
                shutil.copy(path, secret / path.name)
        return secret

    def localise_paths(self, pod: Pod, container: dict[str, Any], values: list[str]) -> list[str]:
        """Paths under a mount point, also inside a shell script, moved into the volume's directory.

        One pass over all mount points, so a rewritten path (itself under /tmp) is never rewritten again.
        """
        mounts = {m["mountPath"].rstrip("/"): str(self.volume_dir(pod, m["name"]))
                  for m in container.get("volumeMounts", [])}
        if not mounts:
            return values
        targets = "|".join(map(re.escape, sorted(mounts, key=len, reverse=True)))
        pattern = re.compile(rf"(?<![\w./-])({targets})(?![\w.-])")
        return [pattern.sub(lambda m: mounts[m.group(1)], a) for a in values]

    def localise(self, pod: Pod, container: dict[str, Any], argv: list[str]) -> list[str]:
        argv = self.localise_paths(pod, container, argv)
        return [*LOCAL_PROGRAMS.get(argv[0], [argv[0]]), *argv[1:]]

    def env(self, pod: Pod, container: dict[str, Any]) -> dict[str, str]:
        """The container's env (its TLS files' paths in the Secret's directory) and the image's."""
        env = container_env(pod, container)
        env = dict(zip(env, self.localise_paths(pod, container, list(env.values())), strict=True))
        # The images' own env and PATH: pshard on the path, the worker image's data set.
        env["PSHARD_DATA_DIR"] = str(self.data_dir)
        env["PATH"] = os.pathsep.join([str(_BIN), os.environ.get("PATH", "")])
        return env

    def start(self, pod: Pod, container: dict[str, Any], *, tf_config: str | None = None,
              name: str | None = None, port: int | None = None) -> Proc:
        argv = self.localise(pod, container, argv_of(pod, container))
        if pod.role in TRAINERS and container is pod.spec["containers"][0]:
            argv += ["--max-steps", MAX_STEPS]
        if "--metrics-port" in argv:  # each pod has its port to itself; here they share one host
            argv[argv.index("--metrics-port") + 1] = "0"
        if "--bind" in argv:  # every interface of the pod on 2222: here, loopback on the pod's own port
            assert port is not None, f"{pod.name} binds: its port is needed"
            argv[argv.index("--bind") + 1] = f"127.0.0.1:{port}"
        env = self.env(pod, container)
        if tf_config is not None:
            env["TF_CONFIG"] = tf_config
        return self.procs.start(name or pod.name, argv, env=env)

    def wait_ready(self, pod: Pod, proc: Proc, port: int) -> None:
        """The readiness probe's own command, in the pod's env (its certificate), aimed at its port."""
        (container,) = pod.spec["containers"]
        command = container["readinessProbe"]["exec"]["command"]
        assert command == HEALTH_PROBE  # localhost:2222, the pod's port, here its rewritten one
        check = [*self.localise(pod, container, command[:-1]), f"127.0.0.1:{port}"]
        env = {**os.environ, **self.env(pod, container)}

        def ready() -> bool:
            if not proc.alive():
                raise AssertionError(f"{pod.name} exited ({proc.popen.returncode}):\n{proc.output()}")
            return subprocess.run(check, env=env, capture_output=True, timeout=30).returncode == 0

        wait_until(ready, STARTUP_TIMEOUT_S, f"{pod.name}'s readiness probe", interval_s=0.2)


def stop_servers(started: dict[str, Proc], names: list[str]) -> None:
    """SIGTERM, as deleting a pod sends it: a server stops cleanly and checkpoints its shard."""
    for name in names:
        assert started[name].alive(), started[name].output()
        started[name].signal_group(signal.SIGTERM)
    for name in names:
        assert started[name].wait(FINISH_TIMEOUT_S) == 0, started[name].output()


def assert_finished(proc: Proc) -> dict[str, str]:
    assert proc.wait(FINISH_TIMEOUT_S) == 0, proc.output()
    final = proc.final()
    assert final is not None, f"{proc.name} printed no final line:\n{proc.output()}"
    return final


def assert_metrics_served(pods: list[Pod], started: dict[str, Proc]) -> None:
    """Every pod of a metrics role served /metrics; the servers' show the job's traffic."""
    for pod in pods:
        if pod.role not in METRICS_ROLES:
            continue
        port = int(started[pod.name].wait_for_line(r"metrics on port (\d+)", STARTUP_TIMEOUT_S).group(1))
        if pod.role == "ps":  # still serving: the job is done, its servers not yet deleted
            traffic = scrape(port).items()
            received = [v for (name, _), v in traffic if name == "pshard_ps_received_bytes_total"]
            assert sum(received) > 0, pod.name
        elif pod.role == "scheduler":
            assert (value(scrape(port), "pshard_scheduler_generation") or 0) > 0, pod.name


def assert_mutual_tls(started: dict[str, Proc], servers: list[str]) -> None:
    for name in servers:
        assert any("mTLS (CA " in line and ", CRL " in line for line in started[name].lines), \
            started[name].output()


def checkpoint_files(directory: Path) -> Iterator[Path]:
    return (p for p in directory.rglob("*") if p.is_file())


@pytest.mark.e2e
def test_tfjob_pods_train_to_completion_as_local_processes(procs: Procs, tmp_path: Path) -> None:
    (tfjob,) = load(TFJOB)
    pods = tfjob_pods(tfjob)
    local = LocalPods(procs, pods, tmp_path)
    local.make_tls_secret(pods)
    local.map_addresses([p.tf_config or "" for p in pods])
    # The operator creates every pod at once; nothing waits for anything but the pods' own retries.
    started: dict[str, Proc] = {}
    for pod in pods:
        (container,) = pod.spec["containers"]
        tf_config = local.rewrite_tf_config(pod.tf_config or "")
        port = local.own_port(pod, pod.tf_config or "") if pod.role != "evaluator" else None
        started[pod.name] = local.start(pod, container, tf_config=tf_config, port=port)
    for pod in pods:
        if "readinessProbe" in pod.spec["containers"][0]:
            local.wait_ready(pod, started[pod.name], local.own_port(pod, pod.tf_config or ""))

    chief = assert_finished(started["pshard-chief-0"])
    assert chief["role"] == "chief", chief
    assert_mutual_tls(started, ["pshard-ps-0", "pshard-ps-1"])
    assert_metrics_served(pods, started)
    for name in ("pshard-worker-0", "pshard-worker-1"):
        assert_finished(started[name])
    assert assert_finished(started["pshard-evaluator-0"])["role"] == "evaluator"
    checkpoints = tmp_path / "volumes" / "pshard-checkpoints"
    state = torch.load(checkpoints / "model.pt", weights_only=True)["state_dict"]
    assert state and all(isinstance(v, torch.Tensor) for v in state.values())
    assert (checkpoints / "metrics-chief-0.jsonl").stat().st_size > 0
    # The job has succeeded; cleanPodPolicy Running deletes the servers, which checkpoint on the way
    # out, each into /checkpoints/<its pod name>.
    stop_servers(started, ["pshard-ps-0", "pshard-ps-1"])
    for name in ("pshard-ps-0", "pshard-ps-1"):
        assert any(checkpoint_files(checkpoints / name)), f"no checkpoint in {checkpoints / name}"


@pytest.mark.e2e
def test_plain_manifests_pods_train_to_completion_as_local_processes(procs: Procs, tmp_path: Path) -> None:
    pods = plain_pods(plain_docs())
    local = LocalPods(procs, pods, tmp_path)
    local.make_tls_secret(pods)
    # Init containers first, each a real process with its own argv; then the pods' services.
    for pod in pods:
        (init,) = pod.spec["initContainers"]
        proc = local.start(pod, init, name=f"{pod.name}-init")
        assert proc.wait(STARTUP_TIMEOUT_S) == 0, proc.output()
    written = {p.name: (local.volume_dir(p, "tf-config") / "tf_config.json").read_text(encoding="utf-8")
               for p in pods}
    for text in written.values():
        ClusterSpec.from_tf_config(text)
    local.map_addresses(list(written.values()))
    for pod in pods:  # what cluster DNS would do, done to the file the init step wrote
        (local.volume_dir(pod, "tf-config") / "tf_config.json").write_text(
            local.rewrite_tf_config(written[pod.name]), encoding="utf-8")
    started = {pod.name: local.start(pod, pod.spec["containers"][0],
                                     port=local.own_port(pod, written[pod.name])) for pod in pods}
    servers = [p for p in pods if p.role in ("scheduler", "ps")]
    for pod in servers:
        local.wait_ready(pod, started[pod.name], local.own_port(pod, written[pod.name]))

    workers = [p.name for p in pods if p.role == "worker"]
    finals = [assert_finished(started[name]) for name in workers]
    assert_mutual_tls(started, [p.name for p in servers])
    assert_metrics_served(pods, started)
    assert sum("test_accuracy" in f for f in finals) == 1, finals  # worker 0, the first rank, evaluates
    models = tmp_path / "volumes" / "pshard-models"
    state = torch.load(models / "model.pt", weights_only=True)["state_dict"]
    assert state and all(isinstance(v, torch.Tensor) for v in state.values())
    for i in range(len(workers)):
        assert (models / f"metrics-worker-{i}.jsonl").stat().st_size > 0
    stop_servers(started, [p.name for p in servers])
    for name in ("pshard-ps-0", "pshard-ps-1"):
        directory = tmp_path / "pods" / name / "checkpoints" / "shard"
        assert any(checkpoint_files(directory)), f"no checkpoint in {directory}"
