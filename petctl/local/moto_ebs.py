"""The account's default EBS key, which moto can set but not read.

moto 5.2 answers ``ModifyEbsDefaultKmsKeyId`` but not ``GetEbsDefaultKmsKeyId`` (NotImplemented),
which ``run-job`` reads to check that Auto Scaling may use the key (petctl/jobs/ebs_key.py). Here
it answers as AWS does (API_GetEbsDefaultKmsKeyId.html): the key set with
``ModifyEbsDefaultKmsKeyId``, else ``alias/aws/ebs``; ``ResetEbsDefaultKmsKeyId`` sets it back.
"""

from __future__ import annotations

from typing import Any


def apply() -> None:
    from moto.core.responses import ActionResult
    from moto.ec2.responses.elastic_block_store import ElasticBlockStore

    def get_ebs_default_kms_key_id(self: Any) -> Any:
        self.error_on_dryrun()
        return ActionResult(
            {"KmsKeyId": getattr(self.ec2_backend, "default_kms_key_id", None) or "alias/aws/ebs"}
        )

    def reset_ebs_default_kms_key_id(self: Any) -> Any:
        self.error_on_dryrun()
        self.ec2_backend.default_kms_key_id = ""
        return ActionResult({"KmsKeyId": "alias/aws/ebs"})

    ElasticBlockStore.get_ebs_default_kms_key_id = get_ebs_default_kms_key_id  # type: ignore[attr-defined]
    ElasticBlockStore.reset_ebs_default_kms_key_id = reset_ebs_default_kms_key_id  # type: ignore[attr-defined]
