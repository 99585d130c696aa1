"""pshard.ps_server: the parameter server.

core/ (store, consistency policies, optimizers, quorum, step times: pure, no wire), tables/ (sparse tables:
table, hash index, compiled kernels, per-row optimizers, sync mode, files), replication/ (dense and table
replication behind one api, the backends a batch travels by, in-sync reports), checkpoints/ (a shard's, a
global checkpoint's part, the request guard), handlers/ (what the server does with a request, whatever
transport brought it), transport/ (gRPC servicers, the fast paths, the replication link's serving side,
the tarpit and the in-flight budget); service.py builds and runs the whole, follower.py follows the
scheduler, settings.py parses its configuration once, __main__.py is `pshard ps`. docs/architecture.md §1
draws the layers; tests/unit/test_layers.py keeps them.
"""
