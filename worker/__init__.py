"""pshard workers: the PSClient, the torch integration and the training CLI."""

# The public client: numpy and grpc only, so importing it needs no torch.
from pshard.worker.client import PSClient

__all__ = ["PSClient"]
