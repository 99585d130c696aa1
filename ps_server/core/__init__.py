"""The parameter server's pure cores: the shard store, consistency policies, optimizers, the sync quorum and
step times. No wire: no grpc, no protobuf, no environment.
"""
