"""The parameter server: shard store, consistency policies, optimizers, gRPC servicer."""
