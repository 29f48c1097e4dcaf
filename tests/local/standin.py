"""A stand-in for ``petctl-agent run`` in the local cloud tests.

It records its environment, starts a grandchild in a new session (as torch's
elastic agent starts its workers: they leave the process group and outlive the agent), and on SIGTERM writes what IMDS says about the instance's lifecycle
to ``drained`` in its agent dir. With ``--ignore-term`` in the ``test:mode`` tag
it ignores SIGTERM (so only the drain timeout or a completed lifecycle action
ends it); with ``crash`` it exits 3 right after starting.
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
