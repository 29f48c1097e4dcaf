"""Changes to moto's behaviour inside the local cloud daemon (never imported elsewhere): the list of
them, and :func:`apply`, which installs them all. Each family lives in its service's module, whose
docstring gives the rule and its source; the numbers are the ones docs and tests cite.

EC2 (:mod:`petctl.local.moto_ec2`):

1. **Private IPs**: drawn at random and claimed machine-wide (an ``flock``\\ ed file per address),
   never reused within a daemon's life; moto hands them out sequentially and reuses freed ones,
   so two local clouds on one machine, or a new and a draining instance, would share one.
6. **Network interfaces**: a secondary interface is detached when its instance terminates, and
   attaching one in use or at a taken device index is refused, as AWS does; moto attached
   anything anywhere and kept it on the terminated instance.
10. **Instance types** AWS describes and moto's table lacks (``p3.2xlarge``, ``g4ad.xlarge``).
11. **Instance profiles from launch templates**: the template's ``IamInstanceProfile`` reaches the
    instance (the ``mount`` shim's ``iam`` option reads it); moto dropped it.
16. **A subnet's MapPublicIpOnLaunch in CloudFormation**: kept; moto dropped it, so setup's public
    subnets read as private.

Auto Scaling (:mod:`petctl.local.moto_autoscaling`, :mod:`petctl.local.moto_warm_pool`,
:mod:`petctl.local.moto_hooks`):

2. **Lifecycle actions**: ``CompleteLifecycleAction`` and ``RecordLifecycleActionHeartbeat``,
   which moto lacks, answered from the reconciler's termination hook.
7. **Warm pools**: moto keeps a warm pool's settings only; :mod:`petctl.local.moto_warm_pool`
   gives it instances, AWS's sizing and lifecycle states, and CloudFormation support.
13. **DescribeAutoScalingGroups IncludeInstances=false** leaves the groups' instances out.
15. **Lifecycle hooks declared on a group** (:mod:`petctl.local.moto_hooks`): moto ignored a
    group's ``LifecycleHookSpecificationList``, so the job's worker group had no hooks.

CloudFormation (:mod:`petctl.local.moto_cloudformation`):

8. **Template caps**: an inline ``TemplateBody`` over 51,200 bytes, a ``TemplateURL`` object over
   1 MB, or a ``TemplateURL`` that is not an https URL of an S3 object in the stack's region is
   refused; moto took any body and any URL.
9. **DeletionPolicy RetainExceptOnCreate**: such a resource is kept with its stack unless the
   create that made it failed; moto knew only ``Retain``.

CloudWatch Logs (:mod:`petctl.local.moto_logs`) and S3 (:mod:`petctl.local.moto_s3`):

3. **Log stream prefix**: ``FilterLogEvents`` honours ``logStreamNamePrefix``; moto returned every
   stream of the group, so ``petctl logs J`` showed other jobs' lines.
5. **PutLogEvents limits**: AWS's batch, event and message caps, and ``rejectedLogEventsInfo`` as
   the API reference defines it.
5b. **DeleteObjects**: at most 1,000 keys a request; moto took any number.

EFS and EBS (:mod:`petctl.local.moto_efs`, :mod:`petctl.local.moto_ebs`):

4. **EFS mount targets**: in one VPC at a time, and a One Zone file system's only in its zone.
12. **EFS access points and file system policies** in CloudFormation: an access point's
    ``Ref``/``Fn::GetAtt`` and AWS's checks of its properties; a file system's ``FileSystemPolicy``.
14. **GetEbsDefaultKmsKeyId** (:mod:`petctl.local.moto_ebs`): moto sets the account's default EBS
    key but could not read it back.

Each patch wraps one moto method with :func:`petctl.local.patching.wrap`; every module's ``apply``
is idempotent.
"""

from __future__ import annotations

from petctl.local import (
    moto_autoscaling,
    moto_cloudformation,
    moto_ebs,
    moto_ec2,
    moto_efs,
    moto_hooks,
    moto_logs,
    moto_s3,
    moto_warm_pool,
)


def apply() -> None:
    """Install the patches (idempotent)."""
    moto_ec2.apply()
    moto_cloudformation.apply()
    moto_autoscaling.apply()
    moto_logs.apply()
    moto_s3.apply()
    moto_warm_pool.apply()
    moto_efs.apply()
    moto_ebs.apply()
    moto_hooks.apply()
