"""The node's life: boot sequence (``agent.Agent``), preflight checks, the instance in its group, the
node's memory-snapshot store (``snapshots``), the end.

May import: the contracts (spec, settings, workarounds), cloud, rendezvous, elastic, worker.
"""
