"""Switches for the agent's workarounds of torch elastic behaviours.

Each workaround is on by default and has an off-switch ``PETCTL_AGENT_NO_<NAME>=1``
(documented in docs/agent.md with the torch behaviour it answers).
"""

from __future__ import annotations

from collections.abc import Mapping

WORKAROUNDS = {
    "SPLIT_STORE": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: etcd-v2 newcomer hangs on the shared agent TCP store",
    "FAST_LAST_CALL": "last_call_timeout 5 s instead of 30 s: every (re-)rendezvous waited 30 s",
    "FAST_HEARTBEAT": "keep-alive 1 s x 5 instead of 5 s x 3: a dead node blocked re-rendezvous ~15-20 s",
    "STORE_TIMEOUT": "EtcdStore timeout 20 s instead of 300 s: node lost mid-rendezvous blocked EtcdStore.get",
    "IDENTICAL_RANKS": "TORCH_ELASTIC_WORKER_IDENTICAL=1: rank assignment without blocking store round-trips",
    "RDZV_RETRY": "retry next_rendezvous on etcd/store errors instead of failing the agent",
    "ETCD_OUTAGE": "tolerate etcd errors while workers run (torch's monitor loop raises and kills the job)",
    "MEMBERSHIP_WATCH": "restart workers when a participant leaves/dies (torch only reacts to waiting nodes)",
    "SYNC_RESTART": "coordinated checkpoint before a scale-up/membership restart (torch kills workers mid-step)",
    "FORKSERVER": "workers fork from a torch-preloaded forkserver (torch starts fresh interpreters each restart)",
    "PDEATHSIG": "workers die with their agent (torch starts them in a new session; they would be orphaned)",
    "PG_KEEPALIVE": "forkserver workers keep destroyed process groups referenced (DDP's Reducer freed "
    "~ProcessGroupGloo under the GIL and hung at exit, agent/petctl_agent/worker/forkserver.py)",
    "STORE_CONNECT": "a plain script's env:// store client waits for rank 0's store to listen (torch's client "
    "backs off 0.36-0.56 s, median, after a refused connect)",
    "LIVE_COMM_HOOK": "live mode: a DDP comm hook that hands back the failed bucket (torchft 0.2.0's ddp.py "
    "asserts after a failed all-reduce, crashing every survivor)",
    "LIVE_BIND": "live mode: torchft's manager, checkpoint server and gloo device on the node's address "
    "(upstream binds [::] or every interface)",
    "LIVE_QUORUM_RETRIES": "live mode: quorum retries (torchft's default 0 fails the training loop when the "
    "lighthouse restarts)",
    "LIVE_LEAVE": "live mode: a draining worker stops heartbeating at its step boundary (torchft has no leave "
    "call; the survivors waited its heartbeat out, or the join timeout while it lived on)",
    "LIVE_QUORUM_IDS": "live mode: quorum ids that name the members (a restarted lighthouse counts from 1 "
    "again: a survivor kept a group of other members or met its peers among the old group's keys)",
}


def switched_off(name: str, env: Mapping[str, str]) -> bool:
    """``PETCTL_AGENT_NO_<name>`` is 1/true/yes in ``env``."""
    if name not in WORKAROUNDS:
        raise KeyError(name)
    return env.get(f"PETCTL_AGENT_NO_{name}", "") in ("1", "true", "yes")
