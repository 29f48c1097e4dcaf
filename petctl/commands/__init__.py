"""The commands of ``petctl``, one module per area (the root group is :mod:`petctl.cli`).

    base.py     setup, teardown, configure, profiles
    run.py      run-job (and its --wait/--follow)
    observe.py  status, list-hosts, logs, jobs, timeline
    control.py  scale, kill-job, upload, local demo
    common.py   what every command shares: the Context decorator, job-name completion, asking

A command parses its options, makes one call, and hands the result to :mod:`petctl.render`.
"""
