"""Errors a user sees: one line saying what failed and what to do next.

Every expected failure is a :class:`PetctlError`; click prints it as
``Error: <message>`` and exits with its ``exit_code``. Anything else is a bug
and is shown with a traceback only under ``--debug``.
"""

from __future__ import annotations

import click


class PetctlError(click.ClickException):
    """An expected failure with a message that tells the user what to do."""

    exit_code = 1


class ConfigError(PetctlError):
    """Bad or missing configuration (profile, region, credentials, flags)."""

    exit_code = 2


class AwsError(PetctlError):
    """An AWS call failed in a way we could name."""


class StackError(PetctlError):
    """A CloudFormation stack failed or is in a state we cannot work with."""


class StackWaitTimeout(StackError):
    """We stopped waiting; the stack itself goes on (it was not touched)."""


class Interrupted(PetctlError):
    """Ctrl-C, after cleaning up: 130 like a shell, so scripts can tell it from a failure."""

    exit_code = 130


class NotFound(PetctlError):
    """The named job, stack or resource does not exist."""

    exit_code = 3


def describe_client_error(err: Exception) -> str:
    """Turn a botocore ClientError into ``Code: message`` without a traceback."""
    response = getattr(err, "response", None) or {}
    info = response.get("Error", {})
    code = info.get("Code") or type(err).__name__
    message = info.get("Message") or str(err)
    return f"{code}: {message}"
