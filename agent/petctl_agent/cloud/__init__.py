"""Talking to AWS and the instance: boto3 clients, IMDS, spec/code fetch, status, log shipping.

May import: the contracts (spec, settings, workarounds).
"""
