"""``<python> -I .../petctl/local/shims/__main__.py COMMAND ARGS…`` (what each ``bin/`` wrapper of
a local instance execs), or ``python -m petctl.local.shims COMMAND ARGS…``."""

import sys

if not __package__:
    # Run by path, as the wrappers do: load this package on its own. Importing it by name would
    # first run petctl.local's __init__ (the client API, click), some 30 ms more on each of the
    # dozen shim calls of a boot.
    import importlib.util
    import os

    _here = os.path.dirname(os.path.abspath(__file__))
    _spec = importlib.util.spec_from_file_location(
        "petctl.local.shims", os.path.join(_here, "__init__.py"), submodule_search_locations=[_here]
    )
    sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_spec.name])

from petctl.local.shims.main import main  # noqa: E402 - after the package is loaded above

main(sys.argv[1:])
