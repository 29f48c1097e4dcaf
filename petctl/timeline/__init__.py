"""A picture of an elastic run: world size, throughput, membership events and what each cost.

Everything here is derived from ``jobs.observe(...).to_dict()``, the ``status --output json``
document (the agents' status documents and their events, docs/contracts.md), so it works the
same for a running or a finished job, on AWS and on the local cloud. Plain Python only: ``build`` turns a status into data (``derive``,
from what ``parse`` reads), ``render_text`` draws it for a terminal (``text``), ``render_html``
writes a self-contained page (``page``: inline SVG, no scripts, no external resources),
``to_json`` is what ``--output json`` prints.

What the agents publish, and so what can be known:

* rendezvous rounds: ``rendezvous_start`` (with the reason and the round being left),
  ``rendezvous_done`` and ``workers_started`` (the new round, its world size);
* leaving: ``drain_requested`` (scale-in or spot notice, with the reason), ``drained``;
  failures: ``workers_failed``, ``failed``; the end: ``succeeded`` (with ``last_step``);
* progress: agents publish a bounded ``progress`` list of ``[t, step]``, ``last_step_at`` and
  a ``step`` on rendezvous/drain/failure/start events; steps/s over time comes from those.
  Documents of older agents carry only their latest ``last_step`` (one sample each).
* an etcd outage that the workers ride out shows as ``rdzv_unreachable``/``rdzv_recovered``
  events; one that wipes the rendezvous state also shows as rounds starting over or as a
  "rendezvous round moved on (a -> b)" reason with b < a.
"""

from petctl.timeline.derive import STOP_KINDS, build
from petctl.timeline.fmt import KIND_LABELS, KIND_LETTERS, iso, to_json
from petctl.timeline.page import render_html, render_svg
from petctl.timeline.text import render_text, rounds_table

__all__ = [
    "KIND_LABELS",
    "KIND_LETTERS",
    "STOP_KINDS",
    "build",
    "iso",
    "render_html",
    "render_svg",
    "render_text",
    "rounds_table",
    "to_json",
]
