"""The cluster as every node sees it: TF_CONFIG parsed once, the parameter layout, the cluster view, replica
placement and the scheduler's client.
"""
