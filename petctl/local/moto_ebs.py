"""The account's default EBS key, which moto can set but not read.

moto 5.2 answers ``ModifyEbsDefaultKmsKeyId`` but not ``GetEbsDefaultKmsKeyId`` (NotImplemented),
which ``run-job`` reads to check that Auto Scaling may use the key (petctl/jobs/ebs_key.py). Here
it answers as AWS does (API_GetEbsDefaultKmsKeyId.html): the key set with
``ModifyEbsDefaultKmsKeyId``, else ``alias/aws/ebs`` (AWS's managed key); ``ResetEbsDefaultKmsKeyId``
sets it back. moto's own stand-in for AWS's managed key, made at the first encrypted volume, is a
customer key in its KMS, so it is never answered: ``alias/aws/ebs`` is.
"""

from __future__ import annotations

from typing import Any

from petctl.local.patching import wrap

AWS_MANAGED = "alias/aws/ebs"


def apply() -> None:
    from moto.core.responses import ActionResult
    from moto.ec2.models.elastic_block_store import EBSBackend
    from moto.ec2.responses.elastic_block_store import ElasticBlockStore

    @wrap(EBSBackend, "modify_ebs_default_kms_key_id")
    def modify(real: Any, self: Any, kms_key_id: str) -> str:
        arn = real(self, kms_key_id)
        self.petctl_default_key = arn if kms_key_id else None
        return arn

    def get_ebs_default_kms_key_id(self: Any) -> Any:
        self.error_on_dryrun()
        return ActionResult(
            {"KmsKeyId": getattr(self.ec2_backend, "petctl_default_key", None) or AWS_MANAGED}
        )

    def reset_ebs_default_kms_key_id(self: Any) -> Any:
        self.error_on_dryrun()
        self.ec2_backend.petctl_default_key = None
        return ActionResult({"KmsKeyId": AWS_MANAGED})

    ElasticBlockStore.get_ebs_default_kms_key_id = get_ebs_default_kms_key_id  # type: ignore[attr-defined]
    ElasticBlockStore.reset_ebs_default_kms_key_id = reset_ebs_default_kms_key_id  # type: ignore[attr-defined]
