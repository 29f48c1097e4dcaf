"""Behind ``petctl_agent.checkpoint``, in the worker: files, sharded DCP, the gloo group, the drain.

May import: the contracts (spec, settings, workarounds), ``petctl_agent.distributed``.
"""
