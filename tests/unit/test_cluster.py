"""TF_CONFIG and the cluster flags, parsed once into a frozen ClusterSpec."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
from pshard.common.cluster.spec import (
    ClusterSpec,
    add_cluster_arguments,
    cluster_config_given,
    cluster_spec_from_args,
    exit_on_config_error,
    split_address,
)
from pshard.common.errors import ClusterConfigError

# Exactly what Kubeflow's TFJob controller writes into a worker pod (tensorflow.go genTFConfigJSONStr).
TFJOB_TF_CONFIG = json.dumps({
    "cluster": {
        "chief": ["mnist-chief-0.kubeflow.svc:2222"],
        "ps": ["mnist-ps-0.kubeflow.svc:2222", "mnist-ps-1.kubeflow.svc:2222"],
        "worker": ["mnist-worker-0.kubeflow.svc:2222", "mnist-worker-1.kubeflow.svc:2222"],
        "evaluator": ["mnist-evaluator-0.kubeflow.svc:2222"],
    },
    "task": {"type": "worker", "index": 1},
    "environment": "cloud",
})


def tf_config(task_type: str = "worker", index: object = 0, **cluster: object) -> str:
    cluster = cluster or {"scheduler": ["scheduler:7000"], "ps": ["ps-0:7100", "ps-1:7100"],
                          "worker": ["worker-0:7200", "worker-1:7200"]}
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def test_tfjob_tf_config_parses_as_written():
    spec = ClusterSpec.from_tf_config(TFJOB_TF_CONFIG)

    assert spec.node_id == "worker-1"
    assert spec.own_address == "mnist-worker-1.kubeflow.svc:2222"
    assert spec.ps_addresses == ("mnist-ps-0.kubeflow.svc:2222", "mnist-ps-1.kubeflow.svc:2222")
    assert spec.worker_ids == ("chief-0", "worker-0", "worker-1")
    assert (spec.data_rank, spec.world_size) == (2, 3)
    # No scheduler entry: the chief hosts it in-process.
    assert spec.scheduler_address == "mnist-chief-0.kubeflow.svc:2222"
    assert not spec.hosts_scheduler


def test_chief_hosts_the_scheduler_when_cluster_has_none():
    raw = tf_config("chief", 0, chief=["chief:2222"], worker=["w0:2222"], ps=["ps0:2222"])

    spec = ClusterSpec.from_tf_config(raw)

    assert spec.hosts_scheduler
    assert spec.scheduler_address == "chief:2222"
    assert (spec.node_id, spec.data_rank) == ("chief-0", 0)


def test_master_is_read_as_chief():
    raw = tf_config("master", 0, master=["master:2222"], worker=["w0:2222"])

    spec = ClusterSpec.from_tf_config(raw)

    assert (spec.task_type, spec.node_id, spec.chief) == ("chief", "chief-0", ("master:2222",))
    assert spec.hosts_scheduler and spec.scheduler_address == "master:2222"


def test_worker_zero_hosts_the_scheduler_without_scheduler_or_chief():
    w0 = ClusterSpec.from_tf_config(tf_config("worker", 0, worker=["w0:1", "w1:1"], ps=["p:1"]))
    w1 = ClusterSpec.from_tf_config(tf_config("worker", 1, worker=["w0:1", "w1:1"], ps=["p:1"]))

    assert w0.hosts_scheduler and not w1.hosts_scheduler
    assert w1.scheduler_address == "w0:1"


def test_scheduler_entry_wins_and_scheduler_task_hosts_it():
    spec = ClusterSpec.from_tf_config(tf_config("scheduler", 0))
    chief = ClusterSpec.from_tf_config(tf_config("chief", 0, scheduler=["s:7000"], chief=["c:1"]))

    assert spec.hosts_scheduler and spec.own_address == "scheduler:7000"
    assert spec.data_rank is None
    assert not chief.hosts_scheduler and chief.scheduler_address == "s:7000"


def test_unknown_keys_are_ignored_and_evaluator_may_be_outside_the_cluster():
    raw = json.dumps({"cluster": {"worker": ["w:1"], "tpu_worker": ["t:1"]},
                      "task": {"type": "evaluator", "index": 0, "trial": "3"}, "rpc_layer": "grpc"})

    spec = ClusterSpec.from_tf_config(raw)

    assert spec.task_type == "evaluator" and spec.own_address is None


@pytest.mark.parametrize("address", ["tfjob-worker-0.ns.svc:2222", "10.0.0.7:7000", "[::1]:7000",
                                     "localhost:1", "host_name:65535", "[fe80::1%eth0]:80"])
def test_valid_addresses(address):
    spec = ClusterSpec.from_tf_config(tf_config("worker", 0, worker=[address]))

    assert spec.own_address == address


def test_split_address_strips_ipv6_brackets():
    assert split_address("[::1]:7000") == ("::1", 7000)
    assert split_address("ps-0:7100") == ("ps-0", 7100)


@pytest.mark.parametrize(("raw", "field", "value"), [
    ("{not json", "TF_CONFIG", "not valid JSON"),
    ("[1, 2]", "TF_CONFIG", "[1, 2]"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), "cluster", "missing"),
    (json.dumps({"cluster": {"worker": ["w:1"]}}), "task", "missing"),
    (json.dumps({"cluster": [], "task": {}}), "cluster", "[]"),
    (json.dumps({"cluster": {"worker": ["w:1"]}, "task": {"index": 0}}), "task.type", "missing"),
    (json.dumps({"cluster": {"worker": ["w:1"]}, "task": {"type": "worker"}}), "task.index", "missing"),
    (tf_config("trainer", 0), "task.type", "'trainer'"),
    (tf_config("chief", 0), "task.type", "no 'chief' entry"),
    (tf_config("worker", "one"), "task.index", "'one'"),
    (tf_config("worker", "1.0"), "task.index", "'1.0'"),
    (tf_config("worker", 1.5), "task.index", "1.5"),
    (tf_config("worker", True), "task.index", "True"),
    (tf_config("worker", -1), "task.index", "-1"),
    (tf_config("worker", 2), "task.index", "has 2 entries"),
    (tf_config("worker", 0, worker=["w0"]), "cluster.worker[0]", "port is missing"),
    (tf_config("worker", 0, worker=["w0:1", "w1:0"]), "cluster.worker[1]", "'w1:0'"),
    (tf_config("worker", 0, worker=["w0:70000"]), "cluster.worker[0]", "'w0:70000'"),
    (tf_config("worker", 0, worker=["w0:http"]), "cluster.worker[0]", "'http'"),
    (tf_config("worker", 0, worker=["w0:1"], ps=["bad host:1"]), "cluster.ps[0]", "'bad host'"),
    (tf_config("worker", 0, worker=["w0:1"], ps=["300.1.1.1:1"]), "cluster.ps[0]", "'300.1.1.1'"),
    (tf_config("worker", 0, worker=["::1:7000"]), "cluster.worker[0]", "needs brackets"),
    (tf_config("worker", 0, worker=["[zz::1]:7000"]), "cluster.worker[0]", "not an IPv6"),
    (tf_config("worker", 0, worker="w0:1"), "cluster.worker", "'host:port'"),
    (tf_config("worker", 0, worker=[7000]), "cluster.worker[0]", "7000"),
    (tf_config("worker", 0, worker=["w:1"], scheduler=["s:1", "t:1"]), "cluster.scheduler", "exactly one"),
    (tf_config("chief", 0, chief=["c:1"], master=["m:1"]), "cluster.master", "m:1"),
    (tf_config("worker", 0, worker=["w:1"], Worker=["v:1"]), "cluster.Worker", "v:1"),
    (tf_config("ps", 0, ps=["p:1"]), "cluster", "host the scheduler"),
    (tf_config("worker", 1, worker={"1": "w1:1"}), "cluster.worker", "[1]"),
])
def test_bad_tf_config_names_the_field_and_value(raw, field, value):
    with pytest.raises(ClusterConfigError) as info:
        ClusterSpec.from_tf_config(raw)

    message = str(info.value)
    assert message.startswith(f"{field}:"), message
    assert value in message


def test_index_out_of_range_says_how_many_entries():
    with pytest.raises(ClusterConfigError) as info:
        ClusterSpec.from_tf_config(tf_config("ps", 5))

    assert str(info.value) == "task.index: got 5, but cluster.ps has 2 entries (valid: 0..1)"


def test_task_index_may_be_a_string_as_tensorflow_reads_it():
    spec = ClusterSpec.from_tf_config(tf_config("worker", "1"))

    assert (spec.task_index, spec.node_id, spec.own_address) == (1, "worker-1", "worker-1:7200")


@pytest.mark.parametrize(("written", "read"), [
    ("Worker", "worker"), ("PS", "ps"), ("Chief", "chief"), ("MASTER", "chief"), ("Scheduler", "scheduler"),
])
def test_task_type_is_read_in_any_case(written, read):
    raw = tf_config(written, 0, scheduler=["s:1"], chief=["c:1"], ps=["p:1"], worker=["w:1"])

    spec = ClusterSpec.from_tf_config(raw)

    assert spec.task_type == read


def test_cluster_job_names_are_read_in_any_case():
    spec = ClusterSpec.from_tf_config(tf_config("PS", 1, Chief=["c:1"], PS=["p0:1", "p1:1"]))

    assert (spec.task_type, spec.own_address, spec.chief) == ("ps", "p1:1", ("c:1",))


def test_task_type_flag_is_read_in_any_case():
    spec = parse(["--task-type", "PS", "--ps", "p:1", "--scheduler", "s:1"])

    assert spec.task_type == "ps"


def test_complete_sparse_cluster_map_is_accepted():
    spec = ClusterSpec.from_tf_config(tf_config("worker", 1, worker={"1": "w1:1", "0": "w0:1"}))

    assert spec.worker == ("w0:1", "w1:1")


def test_spec_is_frozen():
    spec = ClusterSpec.from_tf_config(TFJOB_TF_CONFIG)

    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.task_index = 0  # type: ignore[misc]


# ---- flags ----

def parse(argv: list[str], environ: dict[str, str] | None = None, **kw: str) -> ClusterSpec:
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    return cluster_spec_from_args(parser.parse_args(argv), environ or {}, **kw)


def test_tf_config_comes_from_the_environment():
    spec = parse([], {"TF_CONFIG": TFJOB_TF_CONFIG})

    assert spec.node_id == "worker-1"


def test_flags_override_tf_config_fields():
    spec = parse(["--task-type", "ps", "--task-index", "1", "--ps", "a:1,b:2", "--scheduler", "s:9"],
                 {"TF_CONFIG": TFJOB_TF_CONFIG})

    assert spec.node_id == "ps-1"
    assert spec.ps_addresses == ("a:1", "b:2")
    assert spec.scheduler_address == "s:9"
    # Fields without a flag keep TF_CONFIG's values.
    assert spec.worker == ("mnist-worker-0.kubeflow.svc:2222", "mnist-worker-1.kubeflow.svc:2222")


def test_tf_config_flag_beats_the_environment():
    spec = parse(["--tf-config", tf_config("worker", 0)], {"TF_CONFIG": TFJOB_TF_CONFIG})

    assert spec.own_address == "worker-0:7200"


def test_flags_alone_build_a_cluster():
    spec = parse(["--task-type", "worker", "--task-index", "1", "--scheduler", "127.0.0.1:7000",
                  "--ps", "127.0.0.1:7100", "--worker", "127.0.0.1:7200,127.0.0.1:7201"])

    assert (spec.node_id, spec.own_address, spec.data_rank) == ("worker-1", "127.0.0.1:7201", 1)


def test_default_task_type_applies_without_config():
    spec = parse(["--scheduler", "0.0.0.0:7000"], default_task_type="scheduler")

    assert (spec.node_id, spec.own_address) == ("scheduler-0", "0.0.0.0:7000")


def test_no_config_at_all_names_what_is_missing():
    with pytest.raises(ClusterConfigError, match=r"^task\.type: no TF_CONFIG and no --task-type"):
        parse([])


def test_override_out_of_range_is_checked_against_the_merged_cluster():
    with pytest.raises(ClusterConfigError, match=r"task\.index: got 2, but cluster\.worker has 2 entries"):
        parse(["--task-index", "2"], {"TF_CONFIG": tf_config("worker", 0)})


def test_bad_flag_address_is_a_usage_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as info:
        parse(["--ps", "a:1,b"])

    assert info.value.code == 2
    assert "--ps: got 'b', the port is missing" in capsys.readouterr().err


def test_cluster_config_given():
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)

    assert not cluster_config_given(parser.parse_args([]), {})
    assert cluster_config_given(parser.parse_args([]), {"TF_CONFIG": "{}"})
    assert cluster_config_given(parser.parse_args(["--task-index", "0"]), {})


def test_exit_on_config_error_prints_prog_and_exits_2(capsys):
    @exit_on_config_error(prog="pshard-test")
    def main() -> int:
        ClusterSpec.from_tf_config(tf_config("worker", 9))
        return 0

    with pytest.raises(SystemExit) as info:
        main()

    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("pshard-test: error: task.index: got 9")


def test_exit_on_config_error_without_arguments_passes_results_through():
    @exit_on_config_error
    def main(x: int) -> int:
        return x + 1

    assert main(1) == 2


@pytest.mark.parametrize(("task_type", "index", "listen"), [
    ("ps", 1, "0.0.0.0:7100"),
    ("scheduler", 0, "0.0.0.0:7000"),
    ("worker", 0, "0.0.0.0:7200"),
])
def test_a_task_listens_on_every_interface_at_its_cluster_port(task_type, index, listen):
    spec = ClusterSpec.from_tf_config(tf_config(task_type, index))

    assert spec.listen_address == listen


def test_an_ipv6_cluster_address_listens_on_every_ipv6_interface():
    spec = ClusterSpec.from_tf_config(tf_config("chief", 0, chief=["[fd00::1]:2222"], ps=["p:1"]))

    assert (spec.hosts_scheduler, spec.listen_address) == (True, "[::]:2222")


def test_an_evaluator_outside_the_cluster_has_nowhere_to_listen():
    spec = ClusterSpec.from_tf_config(tf_config("evaluator", 0))

    with pytest.raises(ClusterConfigError, match="no address"):
        _ = spec.listen_address
