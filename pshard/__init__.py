"""pshard: a parameter server for PyTorch training, built as gRPC microservices.

One import namespace over the project's folders (pyproject.toml's package-dir; the layers and the
direction of their dependencies are in docs/architecture.md, 1 Layers):

- ``pshard.common``    (``common/``): cluster config, codec, layout, errors, RPC kit, scheduler client
- ``pshard.ps_server`` (``ps_server/``): shard store, policies, optimizers, handlers, servicer
- ``pshard.scheduler`` (``scheduler/``): the scheduler service
- ``pshard.worker``    (``worker/``):    PSClient, cluster session, torch integration, training CLI
- ``pshard.launcher``  (``launcher/``):  a local cluster as real processes
- ``pshard.api.v1``:   gRPC stubs generated from ``proto/`` at build time (never committed)
"""

import os
import sys

__version__ = "0.2.0"

# Before anything imports grpc, which reads this once: its fork handlers crash forked children such as
# DataLoader workers (pshard.client.forking says why). Left alone when the user set it, or when grpc
# was imported before pshard (then the value stays the one grpc read, and PSTrainer warns).
if "grpc" not in sys.modules:
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
