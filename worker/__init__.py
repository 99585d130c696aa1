"""pshard workers: the PSClient, the torch integration and the training CLI."""
