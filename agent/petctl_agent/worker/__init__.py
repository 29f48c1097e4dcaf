"""The workers: what they get from the agent (``env``) and the forkserver they start from.

May import: the contracts (spec, settings, workarounds), elastic (its torch workaround switches).
"""
