"""What a parameter server does with a request, whatever transport brought it: dense, sparse tables and
global checkpoints.
"""
