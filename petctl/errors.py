"""Errors a user sees: one line saying what failed and what to do next.

Every expected failure is a :class:`PetctlError`; click prints it as
``Error: <message>`` and exits with its ``exit_code``. Anything else is a bug
and is shown with a traceback only under ``--debug``.
"""

from __future__ import annotations

import re

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


#: How long a service's message may be in one of our lines.
MESSAGE_MAX = 300
_TAG = re.compile(r"<[^>]*>")
_TITLE = re.compile(r"<(title|Message|h1)>([^<]+)</", re.I)
_ERRNO = re.compile(r"\[Errno -?\d+\] ([^)\"'\]]+)")


def clean_text(text: str) -> str:
    """A service's message as one plain line: an HTML or XML page becomes its title (or its text
    without tags), whitespace is collapsed, and it is cut to MESSAGE_MAX characters."""
    text = str(text or "")
    if "<" in text and ">" in text:
        m = _TITLE.search(text)
        text = m.group(2) if m else _TAG.sub(" ", text)
    text = " ".join(text.replace("\\n", " ").split())
    return text if len(text) <= MESSAGE_MAX else text[: MESSAGE_MAX - 3] + "..."


def describe_client_error(err: Exception) -> str:
    """An AWS error as ``Code: message`` (one plain line, no traceback, no HTML/XML, no repr); any
    other boto error as :func:`describe_aws_error` says it."""
    response = getattr(err, "response", None) or {}
    info = response.get("Error", {}) if isinstance(response, dict) else {}
    if not info:
        return describe_aws_error(err)
    code = clean_text(info.get("Code") or type(err).__name__)
    message = clean_text(info.get("Message") or "")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    if code.isdigit() and status:  # no AWS error document, an HTTP status (a proxy, a bare 404)
        message = f"HTTP {code} {message}".strip()
    return f"{code}: {message or 'no message'}"


def describe_aws_error(err: Exception) -> str:
    """Any botocore/boto3/urllib3 error as one line a user can act on: the service and operation
    (when known), AWS's error code and message, never an HTTP body, an XML or HTML page, or a
    Python repr. The one translation point: ``cli`` turns every unexpected boto error into this."""
    name = type(err).__name__
    kwargs = getattr(err, "kwargs", None) or {}
    response = getattr(err, "response", None)
    if isinstance(response, dict) and response.get("Error"):
        info = response["Error"]
        where = " ".join(x for x in (info.get("PetctlService"), getattr(err, "operation_name", None)) if x)
        return f"AWS {where or 'request'} failed: {describe_client_error(err)}"
    if name in (
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
    ):
        url = kwargs.get("endpoint_url", "?")
        detail = {"ConnectTimeoutError": "connect timed out", "ReadTimeoutError": "no answer in time"}.get(
            name
        )
        if detail is None:
            m = _ERRNO.search(str(kwargs.get("error", "")))
            detail = (m.group(1).strip() if m else "connection failed").lower()
        return f"cannot reach the AWS endpoint {url} ({detail}); check the network, the region, or AWS_ENDPOINT_URL"
    if name == "ResponseParserError":
        return (
            f"the AWS endpoint answered with something that is not an AWS response "
            f"({clean_text(str(err).partition(chr(10))[2]) or 'unreadable'}); check AWS_ENDPOINT_URL "
            f"(a proxy or the wrong server?), or rerun with --debug"
        )
    if name == "ParamValidationError":
        report = kwargs.get("report") or str(err)
        report = re.sub(r"<class '([\w.]+)'>", r"\1", str(report))
        return "invalid AWS request: " + "; ".join(
            line.strip() for line in str(report).splitlines() if line.strip()
        )
    if name in ("HTTPClientError", "ProxyConnectionError"):
        m = _ERRNO.search(str(kwargs.get("error", "")))
        detail = m.group(1).strip().lower() if m else type(kwargs.get("error")).__name__
        return f"the connection to the AWS endpoint failed ({detail}); check the network or AWS_ENDPOINT_URL"
    if name == "SSLError":
        return f"TLS to the AWS endpoint {kwargs.get('endpoint_url', '')} failed; check the network's proxy or AWS_CA_BUNDLE"
    # Other botocore errors carry a sentence (fmt) of their own; keep its first line, minus reprs.
    first = clean_text(str(err).splitlines()[0] if str(err) else name)
    return f"{name}: {_ERRNO.sub(lambda m: m.group(1), first)}"
