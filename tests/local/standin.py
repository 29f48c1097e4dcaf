"""A stand-in for ``petctl-agent run`` in the local cloud tests.

It records its environment, starts a grandchild in a new session (as torch's
elastic agent starts its workers: they leave the process group and outlive the agent), and on SIGTERM writes what IMDS says about the instance's lifecycle
to ``drained`` in its agent dir. With ``--ignore-term`` in the ``test:mode`` tag
it ignores SIGTERM (so only the drain timeout or a completed lifecycle action
ends it); with ``crash`` it exits 3 right after starting. In a warm pool (IMDS
``target-lifecycle-state`` ``Warmed:*``) it does what the agent does there: publishes status
``WARMED`` to the job's ``status_url`` and waits for ``InService`` before it "joins" (writes
``env.json``).
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

agent_dir = os.environ["PETCTL_AGENT_DIR"]
imds = os.environ["PETCTL_IMDS_URL"]


def imds_get(path):
    req = urllib.request.Request(
        imds + "/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
    )
    token = urllib.request.urlopen(req, timeout=5).read().decode()
    req = urllib.request.Request(imds + "/latest/" + path, headers={"X-aws-ec2-metadata-token": token})
    try:
        return urllib.request.urlopen(req, timeout=5).read().decode()
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"


def write(name, data):
    tmp = os.path.join(agent_dir, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(data)
    os.replace(tmp, os.path.join(agent_dir, name))


def wait_until_in_service():
    target = imds_get("meta-data/autoscaling/target-lifecycle-state")
    if not target.startswith("Warmed:"):
        return
    import boto3

    spec_url = imds_get("meta-data/tags/instance/petctl:spec")
    bucket, _, key = spec_url[5:].partition("/")
    s3 = boto3.client("s3")
    status_url = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())["status_url"]
    _, _, prefix = status_url[5:].partition("/")
    iid = imds_get("meta-data/instance-id")
    s3.put_object(Bucket=bucket, Key=prefix + iid + ".json", Body=json.dumps({"state": "WARMED"}).encode())
    while not imds_get("meta-data/autoscaling/target-lifecycle-state") == "InService":
        time.sleep(0.1)


wait_until_in_service()
mode = imds_get("meta-data/tags/instance/test:mode")
# Like torch elastic's workers: a new session, so it leaves the agent's process group.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
write("env.json", json.dumps({"env": dict(os.environ), "pid": os.getpid(), "child": child.pid, "mode": mode}))
if mode == "crash":
    sys.exit(3)


def on_term(signum, frame):
    write("drained", imds_get("meta-data/autoscaling/target-lifecycle-state"))
    if mode != "ignore-term":
        sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
while True:
    time.sleep(0.2)
