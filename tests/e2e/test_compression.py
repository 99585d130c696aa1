"""Compressed training end to end (issue 19): `pshard launch --ps 2 --workers 2 -- --compression ...`,
Fashion-MNIST, sync mode, real processes over the transports they negotiate.

Short on purpose (a few hundred steps of the MLP): it proves the flags reach the workers, that every
push travels packed (the final lines' compression_ratio) and that the model still learns. The comparison
with uncompressed training at full length, same epochs and seed, is `make bench-compression-accuracy`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import Procs, finals, start_launcher

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(360)]  # the run itself is bounded by TIMEOUT_S

DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
TIMEOUT_S = 300
# Chance is 0.1; a model that learns from what was sent is far past 0.6 after 150 steps (a full epoch of
# top-k 1 % ends at 0.80, uncompressed at 0.85: bench/compression_accuracy.py).
BAR = 0.6


@pytest.mark.skipif(not (DATA_DIR / "train-images-idx3-ubyte.gz").exists(),
                    reason=f"Fashion-MNIST is not in {DATA_DIR} (apt-get install dataset-fashion-mnist)")
def test_topk_pushes_and_pulls_train_fashion_mnist_on_two_servers(procs: Procs) -> None:
    """Pushes as top-k 1 % with error feedback, and pulls as top-k 1 % of the change since each worker's
    copy: the workers train on approximate weights, the servers keep the rest, and the model still
    learns (the full-length comparisons with uncompressed training, pushes only and both ways:
    bench/compression_accuracy.py). One run for both directions: each is a launcher start of about half
    a minute, and push compression alone is proven against one process in the service tests."""
    run = start_launcher(procs, "--ps", "2", "--workers", "2", "--", "--mode", "sync", "--model", "mlp",
                         "--epochs", "1", "--max-steps", "150", "--seed", "0", "--lr", "0.05",
                         "--data-dir", str(DATA_DIR), "--compression", "topk:0.01",
                         "--compression-rule", "*.bias=none", "--pull-compression", "topk:0.01")

    code = run.wait(TIMEOUT_S)

    assert code == 0, run.output()
    lines = finals(run)
    assert set(lines) == {"worker-0", "worker-1"}, run.output()
    for name, fields in lines.items():
        assert float(fields["compression_ratio"]) > 40, (name, fields)  # 1 % as index and value: 50x fewer
        # The first pull is whole, each later one 1 % as index and value.
        assert float(fields["pull_compression_ratio"]) > 20, (name, fields)
    assert float(lines["worker-0"]["test_accuracy"]) >= BAR, lines
