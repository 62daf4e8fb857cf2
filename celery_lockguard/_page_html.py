"""The lock page as HTML: every value from Redis escaped, no inline script or style, sparklines as SVG.

Task ids, task names, worker names and entity keys come from message bodies
anyone with broker access writes and from keys anyone with Redis access can
plant; the web UIs of peer tools shipped XSS fixes for exactly these. So
every value passes :func:`text` -- :func:`~celery_lockguard._terminal.printable`
(control characters and escape sequences shown as ``\\x1b``, long text cut)
then :func:`html.escape` (``<``, ``>``, ``&`` and both quotes) -- and nothing
here builds markup from a value any other way. Numbers are formatted here,
never taken as text from Redis. The page carries no inline script, style or
event handler, so the server's Content-Security-Policy
(:mod:`celery_lockguard._page`) can forbid them all: were a value ever left
unescaped, the browser would still run nothing.

:func:`live` is the part that updates: the page's script (:data:`SCRIPT`)
fetches it again every interval and swaps it in, parsed by ``DOMParser``
(scripts in it never run).
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Iterable, Sequence

from ._holders import HeldLease
from ._page_state import HISTORY_SECONDS, Sample, Snapshot
from ._redact import redact
from ._terminal import duration, entity, plural, printable

#: Longest cell the page shows (the rest is cut and counted, as in the terminal).
MAX_CELL = 256
#: Sparkline size in SVG user units.
SPARK_W, SPARK_H = 240, 40


def text(value: object, limit: int | None = MAX_CELL) -> str:
    """``value`` safe inside HTML text or a quoted attribute: non-printables escaped as text, then HTML-escaped."""
    return html.escape(printable("-" if value is None else value, limit), quote=True)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}" if x >= 0.1 or x == 0 else f"{x:.1%}"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _utc(at: float | None) -> str:
    return "-" if at is None else time.strftime("%H:%M:%S UTC", time.gmtime(at))


def _table(headers: Iterable[str], rows: Iterable[Iterable[str]], cls: str) -> str:
    """A table whose cells are already escaped (headers are literals of this module)."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _error(errors: dict[str, str], section: str) -> str:
    if section not in errors:
        return ""
    return f'<p class="error">could not read the {section}: {text(errors[section], None)}</p>'


# -- sections --------------------------------------------------------------------------------


def _lease_row(lease: HeldLease, waiting: int) -> list[str]:
    bad = lease.malformed

    def cell(value: object, name: str) -> str:
        return "?" if name in bad else text(value)

    where = lease.worker or f"{'?' if 'host' in bad else lease.host or '-'}:{'?' if 'pid' in bad else lease.pid or '-'}"
    if not lease.worker and not lease.host and not lease.pid and not {"host", "pid"} & set(bad):
        where = "-"  # no process holds it (a woken waiter's reservation), as ``lockguard locks`` says
    return [
        f'<span class="key">{text(lease.shown, None)}</span>',
        text(lease.state),
        cell(lease.task_name, "task_name"),
        f'<span class="id">{cell(lease.task_id, "task_id")}</span>',
        text(where),
        cell(lease.fence, "fence"),
        "?" if "acquired_at" in bad else text(duration(lease.held_for_ms)),
        text(duration(lease.ttl_left_ms)),
        str(waiting) if waiting else "",
    ]


def leases_section(snap: Snapshot) -> str:
    count = snap.lease_count if snap.lease_count_exact else f"about {snap.lease_count}"
    out = [f'<section id="leases"><h2>Leases and queue claims <span class="count">{count}</span></h2>']
    out.append(_error(snap.errors, "leases"))
    if snap.leases:
        headers = ["key", "state", "task", "task id", "worker", "fence", "held", "TTL left", "waiting"]
        out.append(_table(headers, (_lease_row(x, snap.waiting.get(x.key, 0)) for x in snap.leases), "leases"))
        if snap.lease_count > len(snap.leases):
            more = plural(snap.lease_count - len(snap.leases), "more row")
            about = "" if snap.lease_count_exact else "about "
            shown = "most waiters, then longest held, first"
            out.append(f'<p class="note">{about}{more} not shown ({shown}; lockguard locks --all lists all)</p>')
        odd = [x for x in snap.leases if x.malformed]
        if odd:
            out.append(f'<p class="note">{plural(len(odd), "lease")} with values no worker writes, shown as ?</p>')
    elif "leases" not in snap.errors:
        out.append(f'<p class="empty">no leases or queue claims under {text(repr(snap.prefix))}</p>')
    if snap.uses:  # lock_limit / lock_rate: slots held N/M and the start window's fill, as `locks` prints
        out.append('<ul class="uses">' + "".join(f"<li>{text(u.text(), None)}</li>" for u in snap.uses) + "</ul>")
    out.append("</section>")
    return "".join(out)


def busy_section(snap: Snapshot) -> str:
    out = ['<section id="busy"><h2>Busiest entities <span class="hint">last hour, as sampled here</span></h2>']
    out.append(_error(snap.errors, "entities"))
    if snap.busy:
        rows = ([text(entity(b.key)), str(b.waiting), str(b.holders), _pct(b.held_share)] for b in snap.busy)
        out.append(_table(["key", "waiting now", "holders seen", "held in samples"], rows, "busy"))
    else:
        out.append('<p class="empty">no entity changed hands or had waiters while this page sampled</p>')
    out.append("</section>")
    return "".join(out)


def sparkline(samples: Sequence[Sample], value: Callable[[Sample], float | None], now: float) -> str:
    """An SVG polyline of one number (x: time, y: scaled to its maximum) over the last hour.

    The x axis spans what the ring holds, up to the hour: a page server
    started five minutes ago draws five minutes across the whole width, not
    a sliver at the right edge.
    """
    recent = [s for s in samples if s.at >= now - HISTORY_SECONDS]
    span = max(now - recent[0].at, 1.0) if recent else HISTORY_SECONDS
    points = [(s.at, v) for s in recent if (v := value(s)) is not None]
    top = max((v for _, v in points), default=0.0) or 1.0
    coords = " ".join(
        f"{SPARK_W * (1 - (now - at) / span):.1f},{SPARK_H - 2 - (SPARK_H - 4) * v / top:.1f}" for at, v in points
    )
    line = f'<polyline points="{coords}"/>' if len(points) > 1 else ""
    dot = ""
    if points:
        x, y = coords.split(" ")[-1].split(",")
        dot = f'<circle cx="{x}" cy="{y}" r="2"/>'
    return (
        f'<svg class="spark" viewBox="0 0 {SPARK_W} {SPARK_H}" width="{SPARK_W}" height="{SPARK_H}" '
        f'role="img" aria-label="last hour">{line}{dot}</svg>'
    )


#: The four numbers: label, how a sample holds it, how it is shown.
FOUR: tuple[tuple[str, Callable[[Sample], float | None], Callable[[float | None], str]], ...] = (
    ("acquisitions / min", lambda s: s.acquisition_rate, _num),
    ("contention", lambda s: s.contention, _pct),
    ("average hold", lambda s: s.avg_hold_ms, lambda v: "-" if v is None else text(duration(v))),
    ("expired-lock rate", lambda s: s.expired_rate, _pct),
)


def numbers_section(snap: Snapshot) -> str:
    out = ['<section id="numbers"><h2>The four numbers <span class="hint">fleet, last minute; sparkline: '
           "this page's last hour</span></h2>", _error(snap.errors, "metrics"), '<div class="cards">']  # fmt: skip
    latest = snap.samples[-1] if snap.samples else None
    for label, value, show in FOUR:
        now_value = show(value(latest)) if latest else "-"
        out.append(
            f'<div class="card"><div class="label">{label}</div><div class="value">{now_value}</div>'
            f"{sparkline(snap.samples, value, snap.taken_at)}</div>"
        )
    out.append("</div>")
    tasks = (snap.summary or {}).get("tasks", {})
    if tasks:
        rows = []
        for task, entry in tasks.items():
            if task == "-" and set(entry["windows"]["total"]["events"]) <= {"lock.renewed"}:
                continue  # renewals counted before a task name was known: no row of their own (as in stats)
            w = entry["windows"]["5m"]
            readings = "".join(f"<li>{text(r, None)}</li>" for r in entry.get("readings", []))
            rows.append(
                [
                    text(task),
                    text(entry.get("key_template", "")),
                    _num(w["acquisition_rate_per_min"]),
                    _pct(w["contention_rate"]),
                    _num(w["avg_hold_ms"], "{:.0f}"),
                    _pct(w["expired_rate"]),
                    f"<ul>{readings}</ul>" if readings else "",
                ]
            )
        headers = ["task", "key", "acq/min (5m)", "contention", "avg hold ms", "expired", "readings"]
        out.append(_table(headers, rows, "tasks"))
    out.append("</section>")
    return "".join(out)


def doctor_section(snap: Snapshot) -> str:
    d = snap.doctor
    out = [f'<section id="doctor"><h2>Doctor <span class="hint">as of {_utc(d.at)}</span></h2>']
    if d.error:
        out.append(f'<p class="error">the checks failed: {text(d.error, None)}</p>')
    elif d.findings is None:
        out.append('<p class="empty">not run yet</p>')
    elif not d.findings:
        out.append('<p class="ok">no findings</p>')
    else:
        out.append('<ul class="findings">')
        for f in d.findings:
            tasks = f' <span class="tasks">tasks: {", ".join(text(t) for t in f.tasks)}</span>' if f.tasks else ""
            out.append(f'<li><code class="code">{text(f.code)}</code> {text(f.message, None)}{tasks}</li>')
        out.append("</ul>")
    out.append("</section>")
    return "".join(out)


def live(snap: Snapshot, now: float | None = None) -> str:
    """The part of the page that updates: ``<div id="live">`` with every section.

    Rendered from the sampler's latest snapshot; one older than its
    ``stale_after`` says so (the sampler is stuck on a slow Redis), so a
    page that looks current always is.
    """
    age = (time.time() if now is None else now) - snap.taken_at
    state = "ok" if snap.status == 200 else f"read failed ({snap.status})"
    if age > snap.stale_after:
        state = f"stale: the last sample is {age:.0f}s old"
    head = (
        f'<p class="asof">as of <time>{_utc(snap.taken_at)}</time> · sampled every {snap.interval:g}s · '
        f'<span class="state">{text(state)}</span></p>'
    )
    body = leases_section(snap) + busy_section(snap) + numbers_section(snap) + doctor_section(snap)
    errors = _error(snap.errors, "redis") + _error(snap.errors, "page")
    return f'<div id="live" data-interval="{snap.interval:g}">{head}{errors}{body}</div>'


def page(snap: Snapshot, redis_url: str | None, base: str) -> str:
    """The whole document: head (stylesheet and script from ``base``, same origin), title, :func:`live`."""
    where = text(redact(redis_url or "-"))
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>lockguard · {text(snap.prefix)}</title>"
        f'<link rel="stylesheet" href="{base}/style.css"><script src="{base}/app.js" defer></script>'
        "</head><body><header><h1>celery-lockguard</h1>"
        f'<p class="where">prefix <code>{text(snap.prefix)}</code> · lock Redis <code>{where}</code> · '
        'read-only · <span id="poll">updates every interval</span></p></header>'
        f"<main>{live(snap)}</main></body></html>"
    )


#: The page's one script (served from the page's own origin; no inline script anywhere).
SCRIPT = """\
"use strict";
// Fetch the live part of the page every interval and swap it in. DOMParser builds an inert document
// (its scripts never run); the server escaped every value, and the CSP forbids inline code besides.
(function () {
  var poll = document.getElementById("poll");
  function every() {
    var live = document.getElementById("live");
    var s = live ? Number(live.getAttribute("data-interval")) : 5;
    return Math.max(0.2, isFinite(s) && s > 0 ? s : 5) * 1000;
  }
  function tick() {
    // location.origin, not a relative URL: a page opened as http://user:pw@host/page would resolve one
    // with the credentials in it, which fetch refuses; the browser sends its cached basic auth itself.
    var url = location.origin + location.pathname.replace(/\\/$/, "") + "/live";
    fetch(url, {cache: "no-store", credentials: "same-origin"})
      .then(function (resp) {
        return resp.text().then(function (body) {
          var fresh = new DOMParser().parseFromString(body, "text/html").getElementById("live");
          var live = document.getElementById("live");
          if (fresh && live) {
            live.replaceWith(document.importNode(fresh, true));
          }
          poll.textContent = resp.ok ? "live" : "last update answered " + resp.status;
        });
      })
      .catch(function (err) { poll.textContent = "update failed: " + err; })
      .then(function () { setTimeout(tick, every()); });
  }
  setTimeout(tick, every());
})();
"""

#: The page's stylesheet (served from the page's own origin; no inline style anywhere).
STYLE = """\
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1d232a; background: #fafbfc; }
h1 { font-size: 1.3em; margin: 0; } h2 { font-size: 1.05em; margin: 1.4em 0 .4em; }
.where, .asof, .hint, .note, .empty { color: #5a6570; } .hint { font-weight: normal; font-size: .85em; }
.count { background: #dde3ea; border-radius: 9px; padding: 0 .5em; font-size: .85em; }
table { border-collapse: collapse; background: #fff; } th, td { padding: .25em .6em; text-align: left;
  border-bottom: 1px solid #e3e7eb; vertical-align: top; } th { font-weight: 600; background: #f0f3f6; }
td { font-family: ui-monospace, monospace; font-size: .92em; max-width: 32em; overflow-wrap: anywhere; }
td ul { margin: 0; padding-left: 1.1em; font-family: system-ui, sans-serif; }
.key { white-space: pre-wrap; }  /* a key's leading, trailing or repeated spaces stay visible */
.cards { display: flex; flex-wrap: wrap; gap: .8em; margin-bottom: .8em; }
.card { background: #fff; border: 1px solid #e3e7eb; border-radius: 6px; padding: .5em .8em; }
.card .label { color: #5a6570; font-size: .85em; } .card .value { font-size: 1.4em; font-weight: 600; }
.spark polyline { fill: none; stroke: #2f6fdb; stroke-width: 1.5; } .spark circle { fill: #2f6fdb; }
.error { color: #a3161a; } .ok { color: #1d7a35; } .findings li { margin-bottom: .4em; }
.code { background: #f0f3f6; padding: 0 .3em; border-radius: 3px; }
"""
