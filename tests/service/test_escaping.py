"""Untrusted text (job names, reasons, quoted training output) leaving the daemon through each
sink: the Markdown report, a chat webhook's `text`, Prometheus labels. Issue 17 cases 4, 5, 6.

Each sink is read back the way its consumer reads it: the Markdown by a real CommonMark renderer
(markdown-it-py, raw HTML allowed as in CommonMark), the webhook body from a real HTTP server,
the metrics by prometheus_client's own parser."""

from __future__ import annotations

import json
import re

from markdown_it import MarkdownIt
from prometheus_client.parser import text_string_to_metric_families

from supervisor.core.states import JobState
from supervisor.daemon.config import MetricsSpec, WebhookSpec
from supervisor.service.metrics import Metrics, RunningJob
from supervisor.service.report import collect, render_markdown
from supervisor.service.webhooks import Webhooks, event_text

from .night import build_night

HOSTILE_NAME = "<script>alert(1)</script>*pwn*"
HOSTILE_REASON = "<img src=x onerror=alert(2)> see [here](http://evil.example/phish)"
HOSTILE_OUTPUT = "RuntimeError: ![beacon](http://evil.example/pixel.png) <http://evil.example> `x` | y"


def _hostile_night(tmp_path):
    state, store = build_night(tmp_path)
    store.update_job(1, name=HOSTILE_NAME)
    store.update_job(3, name="# heading\n- list")
    store.transition(3, JobState.RUNNING, "x")
    store.transition(3, JobState.FAILED, HOSTILE_REASON)
    a = store.attempt(1, 1)
    diag = json.loads(a.diagnosis)
    diag["summary"] = HOSTILE_OUTPUT
    store.update_attempt(1, 1, diagnosis=json.dumps(diag))
    return state, store


def test_case4_report_md_renders_untrusted_text_as_text(tmp_path):
    state, store = _hostile_night(tmp_path)
    md = render_markdown(collect(store, state), {1: "job-1.png"})
    html = MarkdownIt("commonmark").enable("table").render(md)
    tags = re.findall(r"<(\w+)", html)
    assert "script" not in tags and "a" not in tags, html
    assert re.findall(r"<img [^>]*>", html) == ['<img src="job-1.png" alt="job 1" />'], "only our own plot"
    assert "<h1>" in html and html.count("<h1>") == 1, "a name cannot open a heading"
    # The text itself is all there, readable.
    assert "&lt;script&gt;alert(1)&lt;/script&gt;*pwn*" in html
    assert "![beacon](http://evil.example/pixel.png)" in html.replace("&quot;", '"')
    assert "&lt;img src=x onerror=alert(2)&gt;" in html


def test_case5_webhook_text_is_inert_in_slack_and_mattermost(http_server, rlog):
    srv = http_server()
    event = {"event": "failed", "job": 7, "name": "<!channel> @here",
             "message": "<http://evil.example/login|your job's checkpoint> & @everyone [ok](http://evil.example)"}
    text = event_text(event)
    # Slack mrkdwn: & < > are the control characters, escaped as Slack documents.
    assert "<" not in text and ">" not in text
    assert "&lt;!channel&gt;" in text and "&lt;http://evil.example/login|your job's checkpoint&gt;" in text
    assert " &amp; " in text
    # Mattermost and Discord (its /slack URL) render Markdown and plain @-mentions.
    assert not re.search(r"@(here|channel|all|everyone)\b", text)
    assert "](" not in text
    hooks = Webhooks([WebhookSpec(url_env="HOOK", on=["failed"])], log=rlog.log, env={"HOOK": srv.url + "/x"})
    hooks.send(event)
    hooks.close(5)
    (body,) = [json.loads(b) for b in srv.bodies]
    assert body["text"] == text
    assert body["name"] == event["name"], "the JSON fields stay exact for programs"


def _samples(text: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def test_case6_metrics_carry_no_job_names_by_default(tmp_path):
    _, store = build_night(tmp_path)
    m = Metrics(MetricsSpec(address=None))
    m.update(store, [RunningJob(2, "secret-project-x", 2, step=41)])
    text = m.render()
    assert "secret-project-x" not in text and "qwen" not in text
    step = [s for s in _samples(text) if s.name == "oom_supervisor_job_step"]
    assert [(s.labels, s.value) for s in step] == [({"job": "2", "attempt": "2"}, 41)]


def test_case6_job_names_when_asked_for_are_escaped_label_values(tmp_path):
    _, store = build_night(tmp_path)
    name = 'x"} oom_supervisor_jobs{state="failed"} 99\n# TYPE evil gauge\\'
    m = Metrics(MetricsSpec(address=None, job_names=True))
    m.update(store, [RunningJob(2, name, 2, step=41)])
    got = _samples(m.render())
    step = [s for s in got if s.name == "oom_supervisor_job_step"]
    assert [(s.labels, s.value) for s in step] == [({"job": "2", "attempt": "2", "name": name}, 41)]
    failed = [s.value for s in got if s.name == "oom_supervisor_jobs" and s.labels == {"state": "failed"}]
    assert failed == [0], "no sample injected through a name"


def test_table_cells_are_escaped_inline_only_so_figures_read_as_written(tmp_path):
    """A cell never starts a line: "36.2%" and "-" need no escape there (report.md is read raw too),
    while a hostile name in a cell still renders as text."""
    state, store = _hostile_night(tmp_path)
    md = render_markdown(collect(store, state), {1: "job-1.png"})
    rows = [line for line in md.splitlines() if line.startswith("|")]
    assert rows and not any(re.search(r"\\[.\-]", r) for r in rows), "\n".join(rows)
    assert any(re.search(r"\| \d+(\.\d)?% \|", r) for r in rows), "a goodput figure as written"
    html = MarkdownIt("commonmark").enable("table").render(md)
    assert "<h1>" in html and html.count("<h1>") == 1 and "<li>" not in html.split("<h2>")[1], html
    assert "# heading - list" in html
