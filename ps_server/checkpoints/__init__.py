"""A server's checkpoints: its own shard, its part of a global checkpoint, and what a checkpoint request may
ask.
"""
