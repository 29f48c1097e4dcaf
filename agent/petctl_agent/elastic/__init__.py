"""torch's elastic agent, hooked (``agent.PetctlElasticAgent``): joining, stopping, membership, handlers.

May import: the contracts (spec, settings, workarounds), cloud, rendezvous.
"""
