"""Replication and failover (docs/architecture.md, 9 Failures): dense slices and table rows, the links that
carry them, and what primaries report to the scheduler.
"""
