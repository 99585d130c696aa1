"""Run a whole pshard cluster (scheduler, parameter servers, workers) as local processes.

``pshard launch --ps 2 --workers 2 -- <worker args>``: `plan` (pure: ports, TF_CONFIGs, argv),
`supervisor` (the processes) and `cli` (the command line).
"""
