"""The workers: what they get from the agent (``env``) and the forkserver they start from.

May import: the contracts (spec, settings, workarounds), distributed (a worker's wait for rank 0's
store), elastic (its torch workaround switches).
"""
