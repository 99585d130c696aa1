"""The transports over the handlers: the gRPC servicers, the fast paths (shared memory, raw TCP), the
replication link's serving side, the tarpit and the in-flight budget.
"""
