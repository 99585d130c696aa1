"""Replication and failover (docs/architecture.md, 9 Failures): dense slices and table rows, the links that
carry them, and what primaries report to the scheduler.

The handlers see it only through `api` (one interface each for slices and rows, with a no-op for a job
without replicas); how a batch reaches a backup is a chain of `backends` behind the `Link` protocol.
"""
