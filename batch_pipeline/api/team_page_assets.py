"""The team page's stylesheet and script, served from `/team/static/` (the page's CSP admits only its own
origin's, and no inline code): kept here as text, so that any install of the package serves them."""

TEAM_CSS = """\
:root { color-scheme: light; --line: #d8dde3; --muted: #5b6570; --accent: #2455a4; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d232a;
  background: #f6f7f9; }
header { display: flex; align-items: center; gap: 1rem; padding: .6rem 1.5rem; background: #1d2b3a; color: #fff; }
header h1 { font-size: 1.05rem; margin: 0; font-weight: 600; }
header a { color: #fff; }
header .who { margin-left: auto; color: #c9d3de; }
header form { margin: 0; }
main { padding: 1rem 1.5rem 3rem; max-width: 1400px; }
h2 { font-size: 1.1rem; margin: 1.6rem 0 .5rem; }
table { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid var(--line); }
th, td { text-align: left; padding: .35rem .6rem; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: #eef1f4; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.wrap, .wrap { overflow-wrap: anywhere; }
code, .mono { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; font-size: 12.5px; }
.status { display: inline-block; padding: 0 .45rem; border-radius: .6rem; font-size: 12px; background: #e4e7eb; }
[data-status="running"] .status, .status[data-status="running"] { background: #dbe8fb; color: #133e7c; }
[data-status="completed"] .status, .status[data-status="completed"] { background: #dcf2e3; color: #145c2c; }
[data-status="failed"] .status, .status[data-status="failed"] { background: #fbe0e0; color: #8a1c1c; }
[data-status="cancelled"] .status, .status[data-status="cancelled"] { background: #f1ead6; color: #6b5310; }
progress { width: 7rem; vertical-align: middle; }
.phase { color: #52606d; font-size: 12px; }
.label { display: inline-block; margin: 0 .25rem .15rem 0; padding: 0 .35rem; border: 1px solid var(--line);
  border-radius: .3rem; background: #f9fafb; font-size: 12px; }
.muted { color: var(--muted); }
.error { color: #8a1c1c; }
.notice { padding: .6rem .8rem; border: 1px solid #e6b3b3; background: #fdf0f0; margin: .8rem 0; }
.pager { margin: .6rem 0; display: flex; gap: 1rem; }
form.login { max-width: 28rem; margin: 3rem auto; padding: 1.5rem; background: #fff; border: 1px solid var(--line); }
form.login input[type=password] { width: 100%; padding: .45rem; margin: .4rem 0 .9rem; font: inherit; }
button { font: inherit; padding: .3rem .9rem; cursor: pointer; }
a { color: var(--accent); }
"""

# Refreshes the status and progress of every queued or running job shown, from the page's own JSON route
# (the same session), writing text only (textContent, never markup); a job's own page reloads once its job
# has ended, to show its output and errors.
TEAM_JS = """\
"use strict";
(() => {
  const ACTIVE = new Set(["queued", "running"]);
  const EVERY_MS = 3000;
  const AT_MOST = 20;
  // A queued job's status also says its place in the queue, which costs the API more to tell: every 5th round.
  const QUEUED_EVERY = 5;
  let round = 0;

  function show(element, job) {
    const meta = job.metadata || {};
    element.dataset.status = job.status;
    for (const field of element.querySelectorAll("[data-field=status]")) field.textContent = job.status;
    const total = Number(meta.requests_total || 0);
    const done = Number(meta.requests_done || 0);
    for (const field of element.querySelectorAll("[data-field=progress]")) {
      field.textContent = total ? `${done}/${total}` : "";
    }
    for (const bar of element.querySelectorAll("progress")) {
      if (total) { bar.max = total; bar.value = done; }
    }
    for (const field of element.querySelectorAll("[data-field=phase]")) field.textContent = meta.phase || "";
  }

  async function refresh(element) {
    const url = `/team/jobs/${encodeURIComponent(element.dataset.jobId)}/status`;
    const response = await fetch(url, { credentials: "same-origin", headers: { accept: "application/json" } });
    if (!response.ok) return;
    const job = (await response.json()).job;
    show(element, job);
    if (!ACTIVE.has(job.status) && element.dataset.reloadWhenDone === "true") location.reload();
  }

  function poll() {
    const active = [...document.querySelectorAll("[data-job-id]")]
      .filter((element) => ACTIVE.has(element.dataset.status))
      .slice(0, AT_MOST);
    if (!active.length) return;
    const now = active.filter((element) => element.dataset.status === "running" || round % QUEUED_EVERY === 0);
    round += 1;
    Promise.all(now.map((element) => refresh(element).catch(() => undefined)))
      .then(() => setTimeout(poll, EVERY_MS));
  }

  document.addEventListener("DOMContentLoaded", () => setTimeout(poll, EVERY_MS));
})();
"""
