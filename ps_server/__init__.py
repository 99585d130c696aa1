"""The parameter server: shard store, consistency policies, optimizers, request handlers, gRPC servicer."""
