"""Generated at build time from ``proto/pshard/api/v1/*.proto``; the ``*_pb2*`` files are git-ignored."""
