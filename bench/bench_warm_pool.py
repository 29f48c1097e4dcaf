#!/usr/bin/env python
"""Warm pool benchmark: ``petctl --local scale`` +1 taken from a warm pool vs a cold launch.

Each rep runs the example job (``run-job --min 1 --max 3``) twice on one local cloud, through the
real CLI, the real boot script and the real agent: once plain (``cold``: the scale-out launches
an instance, which boots from its user data) and once with ``--warm-pool 1`` (``warm``: the pool's
instance booted earlier, reported WARMED and was paused; the scale-out resumes it). Both modes run
in every rep, alternating which goes first, so the ratio is side by side on the same machine state.

Per run, from the ``petctl --local scale JOB --size 2`` call (t0), on the new node's own agent
status (``status/<instance-id>.json`` events, docs/contracts.md):

* ``ready_s``: its ``workers_ready`` (its worker start path is warm, it is about to join);
* ``training_s``: its ``workers_started`` at world size 2 (the new node trains);
* ``round_s``: the last node's ``workers_started`` at world size 2 (the whole round is done).

Prints a table of medians with cold/warm ratios, and JSON (``--json``).

    python bench/bench_warm_pool.py                 # 2 reps (~4 min here)
    python bench/bench_warm_pool.py --reps 3 --json warm.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from petctl.local.demo import example_script, stepping  # noqa: E402

MODES = ("cold", "warm")
METRICS = ("ready_s", "training_s", "round_s")


class Bench:
    def __init__(self, home: Path, timeout: float) -> None:
        self.env = {**os.environ, "PETCTL_HOME": str(home), "PETCTL_LOCAL_DIR": str(home / "local")}
        self.timeout = timeout
        self._aws: dict[str, Any] = {}

    def petctl(self, *args: str, json_out: bool = True) -> Any:
        cmd = [sys.executable, "-m", "petctl.cli", "--local", *(["-o", "json"] if json_out else []), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"petctl --local {' '.join(args)} failed: {proc.stderr.strip()[-600:]}")
        return json.loads(proc.stdout) if json_out and proc.stdout.strip() else proc.stdout

    def client(self, name: str) -> Any:
        if name not in self._aws:
            import boto3

            info = json.loads((Path(self.env["PETCTL_LOCAL_DIR"]) / "cloud.json").read_text())
            self._aws[name] = boto3.session.Session(
                aws_access_key_id="petctl-local",
                aws_secret_access_key="petctl-local",
                region_name="us-east-1",
            ).client(name, endpoint_url=info["endpoint_url"])
        return self._aws[name]

    def workers(self, job: str) -> list[dict[str, Any]]:
        st = self.petctl("local", "status", "--json")
        return [i for i in st["instances"] if i["job"] == job and i["role"] == "worker"]

    def wait(self, what: str, pred: Any, timeout: float | None = None) -> Any:
        deadline = time.monotonic() + (timeout or self.timeout)
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            time.sleep(0.2)
        raise TimeoutError(f"timed out waiting for {what}")

    def agent_events(self, instance_id: str) -> list[dict[str, Any]]:
        """The node's agent status events (from the status_url of its job spec)."""
        ec2, s3 = self.client("ec2"), self.client("s3")
        inst = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]
        spec_url = next(t["Value"] for t in inst["Tags"] if t["Key"] == "petctl:spec")
        bucket, _, key = spec_url[5:].partition("/")
        status_url = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())["status_url"]
        prefix = status_url[5:].partition("/")[2]
        try:
            doc = json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}{instance_id}.json")["Body"].read())
        except s3.exceptions.NoSuchKey:
            return []
        return doc.get("events", [])

    def run(self, mode: str, job: str) -> dict[str, Any]:
        warm = ["--warm-pool", "1"] if mode == "warm" else []
        self.petctl(
            "run-job", "--name", job, "--min", "1", "--max", "3", *warm, "--drain-timeout", "30",
            str(example_script()), "--", "--total-steps", "1000000", "--step-time", "0.1",
        )  # fmt: skip
        try:
            self.wait("training at world size 1", lambda: stepping(self.petctl("status", job), 1))
            if mode == "warm":
                self.wait(
                    "a paused pool instance",
                    lambda: [i for i in self.workers(job) if i["warm"] == "Warmed:Stopped" and i["paused"]],
                )
            before = {i["instance_id"] for i in self.workers(job) if i["lifecycle_state"] == "InService"}
            t0 = time.time()
            self.petctl("scale", job, "--size", "2")
            (new,) = self.wait(
                "the new node",
                lambda: [
                    i["instance_id"]
                    for i in self.workers(job)
                    if i["lifecycle_state"] == "InService" and i["instance_id"] not in before
                ],
            )

            def started(iid: str) -> float | None:
                return next(
                    (
                        e["t"]
                        for e in self.agent_events(iid)
                        if e["kind"] == "workers_started" and e.get("world_size") == 2
                    ),
                    None,
                )

            t_train = self.wait("the new node training", lambda: started(new))
            t_round = max(
                self.wait(f"{iid} at world size 2", lambda iid=iid: started(iid)) for iid in before | {new}
            )
            ready = next((e["t"] for e in self.agent_events(new) if e["kind"] == "workers_ready"), None)
            return {
                "mode": mode,
                "job": job,
                "instance_id": new,
                "ready_s": round(ready - t0, 2) if ready else None,
                "training_s": round(t_train - t0, 2),
                "round_s": round(t_round - t0, 2),
            }
        finally:
            # kill-job deletes the warm pool itself (a group scaled to zero keeps its pool)
            self.petctl("kill-job", job, "--yes", json_out=False)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        recs = [r for r in records if r["mode"] == mode and "error" not in r]
        out[mode] = {
            m: (statistics.median(v) if (v := [r[m] for r in recs if r.get(m) is not None]) else None)
            for m in METRICS
        }
        out[mode]["runs"] = len(recs)
    out["cold_over_warm"] = {
        m: round(out["cold"][m] / out["warm"][m], 2) if out["cold"][m] and out["warm"][m] else None
        for m in METRICS
    }
    return out


def table(summary: dict[str, Any]) -> str:
    head = f"{'':<16}" + "".join(f"{m:>14}" for m in METRICS) + f"{'runs':>6}"
    lines = ["seconds from `petctl --local scale JOB --size 2` (median)", head]
    for mode in MODES:
        row = summary[mode]
        lines.append(
            f"{mode:<16}"
            + "".join(f"{'-' if row[m] is None else f'{row[m]:.2f}':>14}" for m in METRICS)
            + f"{row['runs']:>6}"
        )
    ratio = summary["cold_over_warm"]
    lines.append(
        f"{'cold / warm':<16}"
        + "".join(f"{'-' if ratio[m] is None else f'{ratio[m]:.2f}x':>14}" for m in METRICS)
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2, help="runs of each mode (default 2)")
    p.add_argument("--timeout", type=float, default=240, help="seconds any one wait may take")
    p.add_argument("--json", type=Path, help="write the records and the summary here")
    a = p.parse_args(argv)
    if a.reps < 1:
        p.error(f"--reps {a.reps}: use 1 or more")
    home = Path(tempfile.mkdtemp(prefix="petctl-bench-warm-"))
    bench = Bench(home, a.timeout)
    records: list[dict[str, Any]] = []
    try:
        bench.petctl("setup")
        for rep in range(a.reps):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                job = f"bwp-{mode}-{rep}"
                try:
                    rec = bench.run(mode, job)
                except (RuntimeError, TimeoutError) as e:
                    rec = {"mode": mode, "job": job, "error": str(e)}
                records.append({"rep": rep, **rec})
                print(json.dumps(records[-1]), flush=True)
    finally:
        subprocess.run(
            [sys.executable, "-m", "petctl.cli", "local", "stop"],
            env=bench.env,
            capture_output=True,
            timeout=120,
        )
    summary = summarize(records)
    print(table(summary))
    doc = {
        "config": {
            "reps": a.reps,
            "machine": f"{platform.node()} {os.cpu_count()} cpus",
            "python": sys.version.split()[0],
        },
        "records": records,
        "summary": summary,
    }
    print(json.dumps(summary, indent=2))
    if a.json:
        a.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
