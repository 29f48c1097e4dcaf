"""What the rule modules share: the rule maker and the readers of template values.

cfn-lint loads only files named ``[A-Za-z1-9]*.py`` from the rules directory, so this one (leading
underscore) is never taken for a rule file. The rule files import it absolutely
(``petctl.lint_rules._common``), as cfn-lint loads them by path, outside the package.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from cfnlint.rules import CloudFormationLintRule, RuleMatch
from cfnlint.template import Template

#: One violation: the path of the offending value in the template, and what is wrong with it.
Finding = tuple[list, str]
Check = Callable[[Template], Iterable[Finding]]


def rule(rule_id: str, source_url: str, *tags: str) -> Callable[[Check], type[CloudFormationLintRule]]:
    """Make a cfn-lint rule class out of a check that yields findings.

    The check's docstring says what the rule promises: its first line is cfn-lint's short
    description, the rest its description. Tags add to ``petctl``, ``security``.
    """

    def make(check: Check) -> type[CloudFormationLintRule]:
        shortdesc, _, description = inspect.cleandoc(check.__doc__ or "").partition("\n")

        def match(self: CloudFormationLintRule, cfn: Template) -> list[RuleMatch]:
            return [RuleMatch(path, message) for path, message in check(cfn)]

        attributes = {
            "__doc__": check.__doc__,
            "__module__": check.__module__,
            "id": rule_id,
            "shortdesc": shortdesc,
            "description": " ".join(description.split()),
            "source_url": source_url,
            "tags": ["petctl", "security", *tags],
            "match": match,
        }
        return type(check.__name__, (CloudFormationLintRule,), attributes)

    return make


def properties(resource: Any) -> dict:
    props = resource.get("Properties") if isinstance(resource, dict) else None
    return props if isinstance(props, dict) else {}


def each_property(cfn: Template, types: list[str], name: str) -> Iterator[tuple[str, Any]]:
    """``(resource name, value of its property name)`` for every resource of one of ``types``."""
    for resource_name, resource in cfn.get_resources(types).items():
        yield resource_name, properties(resource).get(name)


def get_in(value: Any, *keys: str) -> Any:
    """``value[k1][k2]...``, or ``None`` where a level is missing or not a mapping."""
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def is_true(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true")


def as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def strings(value: Any) -> list[str]:
    """Every string literal inside a value, intrinsic functions included (Fn::Sub, Fn::Join...)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in strings(item)]
    return []
