"""Run a whole pshard cluster (scheduler, parameter servers, workers) as local processes.

``python -m pshard.launcher --ps 2 --workers 2 -- <worker args>``; see `launcher.launch`.
"""
