"""The workers: what they get from the agent (``env``) and the forkserver they start from.

May import: the contracts (spec, settings, workarounds), distributed (await_listener), elastic (torch switches).
The forkserver's workers wait for rank 0's store through distributed; elastic holds torch workaround switches.
"""
