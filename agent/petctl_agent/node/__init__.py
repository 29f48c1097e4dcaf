"""The node's life: boot sequence (``agent.Agent``), preflight checks, the instance in its group, the end.

May import: the contracts (spec, settings, workarounds), cloud, rendezvous, elastic, worker.
"""
