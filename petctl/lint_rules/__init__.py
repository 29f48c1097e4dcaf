"""petctl's own cfn-lint rules: the security promises of our templates, checked on every render.

Load them with cfn-lint's ``append_rules`` pointing at :data:`RULES_DIR` (cfn-lint imports each rule
file by path, so the rule modules are self-contained and this package does not import cfn-lint)::

    from cfnlint.api import lint
    from cfnlint.config import ManualArgs
    lint(text, config=ManualArgs(regions=["us-east-1"], append_rules=[str(RULES_DIR)]))

Rule ids: E9101-E9110 (the E9xxx range is unused by cfn-lint's built-in rules).
"""

from pathlib import Path

RULES_DIR = Path(__file__).resolve().parent

#: ids of the rules defined in this directory.
RULE_IDS = ("E9101", "E9102", "E9103", "E9104", "E9105", "E9106", "E9107", "E9108", "E9109", "E9110")
