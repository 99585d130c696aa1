"""Generated gRPC stubs (``pshard.api.v1``), built from ``proto/pshard/api/v1`` by setup.py."""
