"""TensorFlow's ClusterCoordinator sample on pshard: five scheduled additions of 1..5 give 15.

    pshard launch --ps 2 --workers 2 --coordinator examples/coordinator_sum.py

The launcher runs this script as the chief task (the coordinator) and the workers as `pshard worker
--serve`. The variable lives on the parameter servers; `add` runs on whichever worker is free, by name
(nothing is pickled: the workers import this module as `examples.coordinator_sum`), and its push carries
the call's schedule id, so a call run again after its worker died still adds once.

TensorFlow's sample feeds the additions from a per-worker dataset; with two workers each would read its own
1, 2, 3, ... and the sum would depend on which worker ran what. Here the coordinator iterates the dataset
and sends each element as the call's argument, so the result is 15 on any number of workers.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from pshard.coordinator import ClusterCoordinator
from pshard.coordinator.context import RemoteVariable


def dataset_fn() -> Iterator[int]:
    yield from (1, 2, 3, 4, 5)


def add(v: RemoteVariable, x: int) -> int:
    v.assign_add(x)
    return x


def main() -> None:
    with ClusterCoordinator() as coordinator:  # async mode, the servers' SGD with lr 1: a push adds
        v = coordinator.create_variable("v", np.zeros(1, np.float32))
        added = [coordinator.schedule(add, args=(v, x)) for x in dataset_fn()]
        coordinator.join()
        print(f"added {[r.fetch() for r in added]} on {sorted({r.worker for r in added})}")
        print(f"final: v = {v.read_value()[0]:g}")


if __name__ == "__main__":
    main()
