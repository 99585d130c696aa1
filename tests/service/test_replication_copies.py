"""A targeted catch-up copy of dense slices through real servers and channels (issue 20: a drain without
replicas moves each slice to a server that is not a backup of its own).

The source copies only the chosen slices to the target, as to a joiner: their states, then each of their
steps. A target that is gone mid-copy stalls no step and is not reported in sync; one that caught up is
(`copies_in_sync`), and from then on no step of its slices is acknowledged before it has it. A copy taken
out of the view before a switch is released: the target drops it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from pshard.common.cluster.layout import Layout, ParamSpec, plan_layout
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.replication.dense import Replicator
from pshard.ps_server.replication.link import grpc_sender
from pshard.ps_server.settings import ServerSettings

from tests.e2e.harness import free_port, wait_until

WAIT_S = 10.0
STEP_S = 5.0  # far above a step on two local servers, far below the request's deadline
SGD = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
SHAPES = {"a": (300,), "b": (64, 8), "c": (5,)}


def test_a_targeted_copy_takes_only_its_slices_and_counts_in_sync_once_caught_up(start_server, new_client):
    source, target = (start_server(ServerSettings(static_quorum={"w0": 0})) for _ in range(2))
    layout = plan_layout([ParamSpec(k, "float32", s) for k, s in SHAPES.items()], [source.address],
                         slice_bytes=512)  # the worker's routing: every slice on the source
    layout = dataclasses.replace(layout, version=1)
    gone = f"127.0.0.1:{free_port()}"  # a target SIGKILLed mid-copy: nothing answers there
    holder: list[Replicator] = []

    def wire() -> None:
        replicator = Replicator(source.address, grpc_sender(), source.loop)
        source.running.handlers.enable_replication(replicator)
        holder.append(replicator)

    source.call(wire)
    replicator = holder[0]
    client = new_client([source], "w0", layout=layout)
    rng = np.random.default_rng(0)
    client.declare({k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}, SGD)
    ones = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
    keys = [s.key for s in source.running.handlers.store.slots()]
    moving = frozenset(k for k in keys if k.key == "b")
    assert moving and len(moving) < len(keys)
    source.call(lambda: replicator.set_copies({gone: moving}))
    with ThreadPoolExecutor(1) as pool:
        for clock in range(3):  # acknowledged at once: the dead target's copy is not caught up
            pool.submit(client.push_pull, ones, clock).result(timeout=STEP_S)
    assert source.call(replicator.copies_in_sync) == []
    assert source.call(lambda: replicator.in_sync(keys)) == []  # a copy's target is no backup
    assert source.call(replicator.copy_bytes_left) > 0

    source.call(lambda: replicator.set_copies({target.address: moving}))
    wait_until(lambda: source.call(replicator.copies_in_sync) == [target.address], WAIT_S,
               "the copy's target to catch up")
    client.push_pull(ones, 3)  # acknowledged only once the target has it too
    copies = target.running.handlers.replica_set
    assert sorted(map(str, copies.keys())) == sorted(map(str, moving))  # only the chosen slices
    for slot in source.running.handlers.store.slots():
        if slot.key in moving:
            [copy] = [s for s in copies._slots.values() if s.key == slot.key]
            assert copy.version == slot.version == 4
            assert copy.value.tobytes() == slot.value.tobytes(), slot.key

    # Rolled back (taken out of the view before any switch): the target drops what it holds.
    source.call(lambda: replicator.set_copies({}))
    wait_until(lambda: copies.empty, WAIT_S, "the target to drop the rolled-back copy")
    client.push_pull(ones, 4)  # and no step waits for it any more


def test_a_switched_copy_is_the_targets_and_never_released(start_server, new_client, caplog):
    source, target = (start_server(ServerSettings(static_quorum={"w0": 0})) for _ in range(2))
    replicator, _, moving = _copying(source, target, new_client)
    # The layout switched the slices to the target: the views name the copy until it took it over.
    source.call(lambda: replicator.set_copies({target.address: moving}, switched=[target.address]))
    handlers = target.running.handlers
    target.call(lambda: handlers.set_ownership(2, moving))  # the target learns the switched layout
    with caplog.at_level(logging.INFO, logger="pshard.ps.replication"):
        source.call(lambda: replicator.set_copies({}))  # then the views stop naming the copy
    assert "took over" in caplog.text and "rolled back" not in caplog.text
    for slot in source.running.handlers.store.slots():
        if slot.key in moving:  # the target serves the source's bytes, at the source's version
            [mine] = handlers.store.find([slot.key]).values()
            assert (mine.version, mine.value.tobytes()) == (slot.version, slot.value.tobytes())


def _layout(source) -> Layout:
    """Every slice on `source` (the worker's routing before a switch)."""
    return dataclasses.replace(plan_layout([ParamSpec(k, "float32", s) for k, s in SHAPES.items()],
                                           [source.address], slice_bytes=512), version=1)


def _copying(source, target, new_client, **client_args):
    """A copy of the slices of "b" from `source` to `target`, caught up after two steps."""
    layout = _layout(source)
    holder: list[Replicator] = []

    def wire() -> None:
        holder.append(Replicator(source.address, grpc_sender(), source.loop))
        source.running.handlers.enable_replication(holder[0])

    source.call(wire)
    client = new_client([source], "w0", layout=layout, **client_args)
    rng = np.random.default_rng(0)
    client.declare({k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}, SGD)
    ones = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
    client.push_pull(ones, 0)
    moving = frozenset(s.key for s in source.running.handlers.store.slots() if s.key.key == "b")
    source.call(lambda: holder[0].set_copies({target.address: moving}))
    wait_until(lambda: source.call(holder[0].copies_in_sync) == [target.address], WAIT_S,
               "the copy's target to catch up")
    client.push_pull(ones, 1)
    return holder[0], client, moving


def test_a_copy_target_that_becomes_a_backup_gets_every_slice(start_server, new_client):
    source, target = (start_server(ServerSettings(static_quorum={"w0": 0})) for _ in range(2))
    replicator, _, moving = _copying(source, target, new_client)
    keys = [s.key for s in source.running.handlers.store.slots()]
    assert source.call(lambda: replicator.in_sync(keys)) == [] and len(moving) < len(keys)
    source.call(lambda: replicator.set_backups([target.address]))  # a backup takes the other slices too
    wait_until(lambda: source.call(lambda: replicator.in_sync(keys)) == [target.address], WAIT_S,
               "the new backup to hold every slice")
    assert sorted(map(str, target.running.handlers.replica_set.keys())) == sorted(map(str, keys))
    assert source.call(replicator.copies_in_sync) == []  # a backup, not a copy's target


def test_a_push_that_waited_across_the_switch_is_refused_and_re_routed(start_server, new_client):
    """The source acknowledges a step of a slice only while it still owns it once the copies have it: one
    that waited for the target across a switch (the copy then leaves the views, and the source stops
    waiting) would be acknowledged by the old owner and lost. It is refused with the re-route error, and
    the worker, without replicas, sends the step again by the switched layout: applied once."""
    source, target = (start_server(ServerSettings(static_quorum={"w0": 0})) for _ in range(2))
    published: list[Layout] = []
    switched = threading.Event()

    def relayout(layout: Layout, timeout_s: float) -> Layout | None:  # the scheduler's GetLayout, in short
        return published[0] if switched.wait(timeout_s) and published[0].version > layout.version else None

    replicator, client, moving = _copying(source, target, new_client, relayout=relayout)
    before = _layout(source)
    published.append(dataclasses.replace(
        before, version=2, servers=(source.address, target.address),
        slices=tuple(dataclasses.replace(s, server=int(s.slice_key in moving)) for s in before.slices)))
    handlers = target.running.handlers
    reached, go_on = threading.Event(), threading.Event()
    apply = handlers.replicate

    def held(*args, **kwargs):  # the target's copy of the next step waits here (the source's ack with it)
        reached.set()
        go_on.wait(WAIT_S)
        return apply(*args, **kwargs)

    handlers.replicate = held
    ones = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
    keys = frozenset(s.key for s in source.running.handlers.store.slots())
    with ThreadPoolExecutor(1) as pool:
        step = pool.submit(client.push_pull, ones, 2)
        assert reached.wait(WAIT_S), "the step's copy to reach the target"
        # The switch: the layout moves the slices to the target, which takes them over; the views then
        # stop naming the copy, so the source waits for its target no more.
        source.call(lambda: source.running.handlers.set_ownership(2, keys - moving))
        source.call(lambda: replicator.set_copies({target.address: moving}, switched=[target.address]))
        target.call(lambda: handlers.set_ownership(2, moving))
        source.call(lambda: replicator.set_copies({}))
        switched.set()
        try:
            step.result(timeout=STEP_S)
        finally:
            go_on.set()
    assert client.reroutes == 1  # refused by the source, sent again to the target
    for key in moving:  # steps 0, 1 and 2 on the target, each once
        [mine] = handlers.store.find([key]).values()
        assert mine.version == 3, key
    client.push_pull(ones, 3)  # and training goes on by the new layout
