"""What crosses the wire: the one codec, the dtype table, the fast paths' frames and shared-memory segments,
slice framing, the sparse tables' specs.
"""
