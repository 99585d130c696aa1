"""pshard.client: what users import to talk to parameter servers (PSClient, the tables client and the fast
paths). numpy and grpc only: no torch.
"""
