"""Every command's text output; ``--output json`` prints the result documents themselves.

Each function takes a command's result document (a ``to_dict()`` or a plain dict) and returns
the text a person reads. Tables go through :func:`petctl.ui.table`.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from petctl import ui
from petctl.ui import cmd, table
from petctl_agent.spec import TORCHFT_VERSION


def setup_text(r: dict[str, Any]) -> str:
    lines = [f"base stack {r['stack']} {r['action']} ({r['status']}) in {r['region']}"]
    lines += [f"  {k}: {v}" for k, v in sorted(r["outputs"].items())]
    lines.append(f"profile {r['profile']!r} saved to {r['profile_path']}")
    lines.append(f"next: {cmd('run-job --min 1 --max 2 train.py')}")
    return "\n".join(lines)


def teardown_text(r: dict[str, Any]) -> str:
    if not r["removed_stacks"] and not r["efs_deleted"]:
        lines = [f"nothing to remove for profile {r['profile']!r}"]
    else:
        lines = [f"removed: {', '.join(r['removed_stacks'] + r['efs_deleted'])}"]
        lines[0] += f" (emptied {r['objects_deleted']} S3 objects)"
    if r["kept"]:
        lines.append(r["kept"])
    if r.get("left_behind"):
        lines.append(f"left behind (delete by hand): {', '.join(r['left_behind'])}")
    elif r["removed_stacks"]:
        lines.append("left behind: nothing")
    return "\n".join(lines)


def configure_text(r: dict[str, Any]) -> str:
    missing = r["missing_for_jobs"]
    state = "ready for jobs" if not missing else f"still missing: {', '.join(missing)}"
    return f"profile {r['name']!r} saved to {r['profile_path']} ({state})"


def profiles_table(rows: list[dict[str, Any]]) -> str:
    return table(rows, ["profile", "region", "stack", "ready"]) if rows else "no profiles"


def started_text(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"job {r['job']} started: {r['size']} x {r['instance_type']} (min {r['min']}, max {r['max']})",
            f"  rendezvous: {r['rendezvous_endpoint']}",
            f"  code and status: {r['s3_prefix']}",
            f"  watch it:  {cmd('status ' + r['job'])}   |   {cmd('logs ' + r['job'] + ' --follow')}",
            f"  scale it:  {cmd('scale ' + r['job'] + ' --size N')}",
            f"  stop it:   {cmd('kill-job ' + r['job'])}",
        ]
    )


def _membership_text(spec: dict[str, Any]) -> str:
    if spec.get("live"):
        return (
            f"live: survivors never restart; torchft {TORCHFT_VERSION}'s lighthouse beside etcd, port "
            f"{spec.get('lighthouse_port')} from the job's workers only"
        )
    return "restart: every worker restarts at a join, drain or loss and takes the state back"


def _warm_pool_text(size: int) -> str:
    if not size:
        return "none (a scale-up boots and installs from scratch)"
    return f"{size} stopped instance(s), pre-booted with the job's environment, taken first by a scale-up"


def plan_text(p: dict[str, Any], show_template: bool = False) -> str:
    """The short plan a dry run prints: what would be made, its sizes, image and costs."""
    par, spec = p["parameters"], p["spec"]
    from petctl.jobs.request import DEFAULT_RDZV_INSTANCE_TYPE  # not at import: --help stays light
    from petctl.templates.etcd import ETCD_SHA256, ETCD_VERSION

    gpu = bool(p.get("gpu"))
    types = par.get("InstanceTypes", par["InstanceType"])
    workers = f"{spec['min_nodes']}-{spec['max_nodes']} x {types} (start {par['DesiredCapacity']})"
    if "OnDemandBaseCapacity" in par:
        workers += f"; spot above {par['OnDemandBaseCapacity']} on-demand (price-capacity-optimized)"
    else:
        workers += "; on-demand"
    image = (
        f"{par['ImageId']} (--ami)"
        if "ImageId" in par
        else "Deep Learning Base OSS Nvidia Driver AMI, Amazon Linux 2023 (from SSM at deploy)"
        if gpu
        else "Amazon Linux 2023 (from SSM at deploy)"
    )
    uploads = [f"  {u['s3_url']}  ({u['bytes']:,} bytes, from {u['from']})" for u in p["uploads"]]
    lines = [
        f"plan for job {p['job']} (stack {p['stack']}) -- nothing will be created",
        f"  workers:      {workers}",
        f"  image:        {image}; {'CUDA' if gpu else 'CPU'} torch {spec.get('torch_version')} on every node",
        f"  rendezvous:   etcd on 1 x {par.get('RdzvInstanceType', DEFAULT_RDZV_INSTANCE_TYPE)}: "
        + (
            f"the {ETCD_VERSION} release from {par['EtcdUrl']}, SHA-256 pinned"
            if par.get("EtcdSha256") in ETCD_SHA256.values()
            else f"your copy {par['EtcdUrl']} (SHA-256 {par['EtcdSha256'][:12]}...)"
            if par.get("EtcdUrl")
            else f"the official {ETCD_VERSION} release, SHA-256 pinned"
        ),
        f"  membership:   {_membership_text(spec)}",
        f"  elasticity:   drain timeout {spec['drain_timeout']} s, {spec.get('max_restarts')} restarts for "
        f"failures, {spec.get('join_timeout')} s to reach --min, stops after "
        f"{spec.get('max_node_failures')} node failures since it last trained",
        f"  checkpoints:  EFS {par['EfsId']}:/{spec['checkpoint_dir']}",
        f"  warm pool:    {_warm_pool_text(int(par.get('WarmPoolSize', 0)))}",
        *([f"  network:      {_efa_text(p, par)}"] if p.get("efa_interfaces") else []),
        f"  packages:     {_packages_text(p.get('requirements'), spec.get('torch_version'))}",
        "  uploads:",
        *uploads,
    ]
    if show_template:
        lines += ["", "template:", p["template"]]
    else:
        lines.append("(--show-template prints the CloudFormation template)")
    return "\n".join(lines)


def _efa_text(p: dict[str, Any], par: dict[str, Any]) -> str:
    """An EFA job's line: its interfaces, and where its placement group puts the workers."""
    n = int(p["efa_interfaces"])
    where = (
        f"a cluster placement group in {par['SubnetIds']}'s zone"
        if p.get("placement_group")
        else "no placement group (--no-placement-group)"
    )
    return f"EFA, {n} interface{'s' if n > 1 else ''} per worker (one per network card); {where}"


def _packages_text(reqs: dict[str, Any] | None, torch: str | None) -> str:
    """What every node installs into the job's environment after torch (a dry run's line)."""
    if not reqs:
        return f"torch {torch} and petctl only (no requirements.txt in the project, no --requirements)"
    names = ", ".join(reqs["requirements"]) or "no requirement lines"
    return f"from {reqs['file']}, on every node after torch {torch} (pinned): {names}"


def _event_extra(e: dict[str, Any]) -> str:
    """An event's fields worth a line in ``status``; a memory snapshot's restore says where each
    shard came from and the step the job went back to (docs/contracts.md, ``snapshot_restored``)."""
    if not str(e.get("kind", "")).startswith("snapshot_"):
        keys: tuple[str, ...] = ("round", "world_size", "reason")
        return ", ".join(f"{k}={e[k]}" for k in keys if e.get(k) is not None)
    parts = [f"{k}={e[k]}" for k in ("source", "step") if e.get(k) is not None]
    shards = e.get("shards")
    if isinstance(shards, dict) and shards:  # sharded state: {"self": [owner ranks], "peer": ..., "efs": ...}
        parts.append(
            "shards " + "; ".join(f"{src} {','.join(str(r) for r in ranks)}" for src, ranks in shards.items())
        )
    if e.get("back_to") is not None:
        parts.append(f"went back to step {e['back_to']} (newest {e.get('newest')})")
    if e.get("reason") is not None:
        parts.append(f"reason={e['reason']}")
    return ", ".join(parts)


def status_text(r: dict[str, Any]) -> str:
    """``status``: the state, sizes and progress, a table of hosts, the newest boot and events."""
    lines = [
        f"job {r['job']}: {r['state']}  (stack {r['stack_status']})",
        f"  workers: desired {r['desired']}, in service {r['in_service']}, min {r['min']}, max {r['max']}",
        (
            f"  world size {r['world_size'] or '-'}, step {r['last_step'] if r['last_step'] is not None else '-'}, "
            f"checkpoint step {r['last_checkpoint_step'] if r['last_checkpoint_step'] is not None else '-'}, "
            f"rendezvous rounds {r['rounds']}, restarts {r['restarts']}, up {ui.duration(r.get('uptime_s'))}"
            if r.get("reports_progress", True)
            else f"  world size {r['world_size'] or '-'}, up {ui.duration(r.get('uptime_s'))}, "
            f"rendezvous rounds {r['rounds']}, restarts {r['restarts']}; the script reports no progress "
            f"(it does not use petctl_agent.checkpoint, so steps and checkpoints are not known)"
        ),
        "",
        table(
            r["hosts"],
            [
                "role",
                "instance_id",
                "private_ip",
                "lifecycle_state",
                "agent_state",
                "world_size",
                "last_step",
            ],
        ),
    ]
    worker_boots = [b for b in r.get("boot_events") or [] if b.get("role") == "worker"]
    if worker_boots:  # the newest worker boot, phase by phase (docs/contracts.md, Boot events)
        b = worker_boots[-1]
        phases = ", ".join(f"{p['kind']} +{p['seconds']:.1f}s" for p in b["phases"])
        lines.insert(
            2,
            f"  boot of {b['instance_id']} ({len(worker_boots)} worker boots): {phases}; {b['seconds']:.1f}s",
        )
    if r.get("etcd_alarm"):  # no round can form until it is fixed: right under the state
        lines.insert(1, f"  {r['etcd_alarm']}")
    for k, line in enumerate(r.get("excluded") or []):  # after the events that said so scroll away
        lines.insert(1 + bool(r.get("etcd_alarm")) + k, f"  {line}")
    lost = {k: v for k, v in (r.get("log_events_lost") or {}).items() if v}
    if lost:  # the agents counted worker lines CloudWatch Logs did not store
        causes = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in lost.items())
        lines.insert(
            3,
            f"  logs: {sum(lost.values())} worker lines not in CloudWatch Logs ({causes}); "
            "each node's stdout (journal) has them all",
        )
    if r["events"]:
        lines += ["", "recent events:"]
        t0 = r["events"][0].get("t", 0)
        for e in r["events"][-12:]:
            extra = _event_extra(e)
            lines.append(
                f"  +{e.get('t', 0) - t0:7.1f}s  {e.get('instance_id', '?'):<20} {e.get('kind', '?'):<18} {extra}"
            )
    if r.get("reason"):
        boot = r.get("boot_failures") or {}
        tail = (
            [f"  the newest failed boot's log ({boot['instance_id']}) ends:"]
            + ["    " + line for line in boot.get("last_lines") or []]
            if r["state"] == "FAILED" and boot.get("count") and boot.get("last_lines")
            else []
        )
        lines[1:1] = [f"  reason: {r['reason']}", *tail]
    return "\n".join(lines)


def hosts_table(rows: list[dict[str, Any]]) -> str:
    return table(rows, ["role", "instance_id", "private_ip", "availability_zone", "lifecycle_state", "ssm"])


def jobs_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no jobs"
    return table(
        [{**j, "age": ui.ago(j["created"])} for j in rows],
        ["job", "state", "min", "max", "desired", "in_service", "age"],
    )


def scaled_text(r: dict[str, Any]) -> str:
    return f"{r['job']}: desired workers {r['from']} -> {r['to']} (range {r['min']}-{r['max']})"


def killed_text(r: dict[str, Any]) -> str:
    job = r["job"]
    if r["deleted"] and not r["waited"]:
        return (
            f"job {job}: deletion started; `{cmd('jobs')}` shows it until it is gone. Its S3 files and "
            f"TLS keys stay (should the deletion fail, its instances still need them): run "
            f"`{cmd('kill-job ' + job)}` again once it is gone to delete them"
        )
    if r["deleted"] and r.get("checkpoints_deleted"):
        return f"job {job} deleted, its checkpoints too, every instance gone, in {r['seconds']}s"
    if r["deleted"]:
        return f"job {job} deleted, every instance gone, in {r['seconds']}s; checkpoints kept at {r['checkpoints_kept']}"
    return f"job {job} does not exist (already deleted?); nothing to do"


def uploaded_text(r: dict[str, Any]) -> str:
    return "\n".join(r["uploaded"]) + f"\n{r['count']} file(s) uploaded"


def log_line(ev: dict[str, Any], as_json: bool) -> str:
    """One log event: ``HH:MM:SS <instance> <message>``, or a JSON line."""
    if as_json:
        return json.dumps(
            {"stream": ev["logStreamName"], "timestamp": ev["timestamp"], "message": ev["message"]}
        )
    ts = dt.datetime.fromtimestamp(ev["timestamp"] / 1000, dt.timezone.utc).strftime("%H:%M:%S")
    return f"{ts} {ev['logStreamName'].split('/', 1)[-1]} {ev['message'].rstrip()}"
