"""deploy/ against the real thing: a real Prometheus scrapes a `pdserve launch` cluster
under load, and every PromQL expression of the Grafana dashboard and of the alert rules
returns data through Prometheus' HTTP API; promtool accepts the config and the rules;
every pdserve flag the deploy files and docs/deploy.md use exists.

How expressions are evaluated:
- Dashboard: Grafana's variables are replaced as with "All" selected ($model_name and
  $node -> ``.*``) and ``$__rate_interval`` -> ``1m``.
- Alert rules compare a measurement to a threshold (``<measurement> > 2``); on a healthy
  cluster the whole expression rightly returns nothing, so the measurement is evaluated:
  the left side of the expression's first comparison outside (), {}, [] and strings
  (``measurement()`` below). Rules must keep that shape.
"Returns data" means at least one series, and at least one finite value (a quantile of
a histogram nothing was observed in would be NaN).

Prometheus is Debian's ``prometheus`` package (CI: .ci/install-prometheus.sh); without it
the Prometheus tests skip and say so.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster import free_port, launched

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
RULE_FILES = sorted(glob.glob(str(DEPLOY / "prometheus" / "rules" / "*.yml")))
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
NOT_INSTALLED = ("Prometheus is not installed ({} not found): apt-get install prometheus, "
                 "or run .ci/install-prometheus.sh as CI does")
needs_prometheus = pytest.mark.skipif(not os.access(PROMETHEUS, os.X_OK),
                                      reason=NOT_INSTALLED.format(PROMETHEUS))
needs_promtool = pytest.mark.skipif(not os.access(PROMTOOL, os.X_OK),
                                    reason=NOT_INSTALLED.format(PROMTOOL))
GRAFANA_VARS = {"$__rate_interval": "1m", "$model_name": ".*", "$node": ".*"}
LOAD_S = 6.0
SETTLE_S = 15.0  # how long queries may take to show data after the load
COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")


def measurement(expr: str) -> str:
    """The left side of ``expr``'s first top-level comparison, or ``expr`` if it has none."""
    depth, quote, i = 0, None, 0
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif depth == 0 and expr.startswith(COMPARISONS, i):
            return expr[:i].strip()
        i += 1
    return expr.strip()


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "pdserve.json").read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unknown variable in {target['expr']!r}"
            out.append((f"panel {panel['title']!r} {target['refId']}", expr))
    return out


def rules() -> list[dict]:
    return [rule for f in RULE_FILES for group in yaml.safe_load(open(f))["groups"]
            for rule in group["rules"]]


# -- without Prometheus -------------------------------------------------------------------------
def test_measurement_splits_at_the_top_level_comparison():
    assert measurement('up{job=~"a.*"} == 0') == 'up{job=~"a.*"}'
    assert measurement('sum(rate(x{code!~"a|b"}[5m])) / sum(y) > 0.05') == \
        'sum(rate(x{code!~"a|b"}[5m])) / sum(y)'
    assert measurement("sum by (r) (x) < sum by (r) (max_over_time(x[30m]))") == \
        "sum by (r) (x)"
    assert measurement('x{a=">"}') == 'x{a=">"}'


def test_k8s_prometheusrule_holds_the_same_rules():
    groups = [g for f in RULE_FILES for g in yaml.safe_load(open(f))["groups"]]
    k8s = yaml.safe_load((DEPLOY / "k8s" / "base" / "prometheusrule.yaml").read_text())
    assert k8s["kind"] == "PrometheusRule"
    assert k8s["spec"]["groups"] == groups, "deploy/k8s/base/prometheusrule.yaml drifted " \
        "from deploy/prometheus/rules/: copy the groups over"


def test_every_pdserve_flag_in_deploy_files_and_docs_exists():
    from pdserve.cli import main

    uses = []   # (where, argv after "pdserve")
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        if str(svc.get("image", "")).startswith("pdserve"):
            uses.append((f"compose service {name}", [str(a) for a in svc["command"]]))
    args = {}   # Deployment name -> its container's args
    for path in sorted((DEPLOY / "k8s" / "base").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "Deployment":  # (not a patch)
                (c,) = doc["spec"]["template"]["spec"]["containers"]
                args[doc["metadata"]["name"]] = [str(a) for a in c["args"]]
                uses.append((f"k8s/base/{path.name}", args[doc["metadata"]["name"]]))
    # Overlays add args with JSON patches: their command plus what they add.
    for kust in sorted((DEPLOY / "k8s").glob("*/kustomization.yaml")):
        for patch in yaml.safe_load(kust.read_text()).get("patches", []):
            ops = yaml.safe_load((kust.parent / patch["path"]).read_text())
            added = [str(op["value"]) for op in ops if op["path"].endswith("/args/-")]
            uses.append((f"{kust.parent.name}/{patch['path']}",
                         args[patch["target"]["name"]][:1] + added))
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", DOCS.read_text(), flags=re.S)
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        m = re.search(r"(?:^|\s)pdserve\s+(\S.*)$", line.strip())
        if m and m.group(1).split()[0] in main.commands:
            uses.append((f"docs/deploy.md: {line.strip()[:60]}", shlex.split(m.group(1),
                                                                              comments=True)))
    assert len(uses) >= 6, uses
    for where, argv in uses:
        cmd = main.commands.get(argv[0])
        assert cmd is not None, f"{where}: no command 'pdserve {argv[0]}'"
        known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        flags = {a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")}
        assert flags <= known, f"{where}: pdserve {argv[0]} has no {sorted(flags - known)}"


def test_kustomizations_name_existing_files():
    for kust in sorted((DEPLOY / "k8s").glob("*/kustomization.yaml")):
        spec = yaml.safe_load(kust.read_text())
        for res in spec.get("resources", []):
            assert (kust.parent / res).exists(), f"{kust}: {res}"
        for patch in spec.get("patches", []):
            assert (kust.parent / patch["path"]).is_file(), f"{kust}: {patch['path']}"


@needs_promtool
def test_promtool_accepts_config_and_rules():
    for args in (["check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                 ["check", "rules", *RULE_FILES]):
        proc = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


# -- a real Prometheus over a real cluster ------------------------------------------------------
def prometheus_config(urls: dict[str, str], path: Path) -> None:
    """deploy/prometheus/prometheus.yml, pointed at the launched ports and scraping fast."""
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    cfg["rule_files"] = RULE_FILES
    targets = {"pdserve-router": [urls["router"]], "pdserve-prefill": [urls["prefill-0"]],
               "pdserve-decode": [urls["decode-0"]]}
    for job in cfg["scrape_configs"]:
        hostports = [re.match(r"http://([^/]+)/metrics", u).group(1)
                     for u in targets.pop(job["job_name"])]
        job["static_configs"] = [{"targets": hostports}]
    assert not targets, f"deploy/prometheus/prometheus.yml lacks jobs {list(targets)}"
    path.write_text(yaml.safe_dump(cfg))


def query(base: str, expr: str) -> list:
    resp = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    body = resp.json()
    assert body.get("status") == "success", f"{expr}: {body}"
    return body["data"]["result"]


def load(http_url: str, model: str, stop: threading.Event, sent: list) -> None:
    """Requests back to back until ``stop``: completions and streamed chat, in turn."""
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            chat = len(sent) % 2
            body = {"model": model, "max_tokens": 8, "temperature": 0}
            if chat:
                body.update(messages=[{"role": "user", "content": "hi"}], stream=True)
            else:
                body["prompt"] = "Once upon a time"
            r = client.post(f"{http_url}/v1/{'chat/completions' if chat else 'completions'}",
                            json=body)
            assert r.status_code == 200, r.text
            sent.append(1)


@pytest.fixture(scope="module")
def prometheus(tiny_model, tmp_path_factory):
    """Prometheus' URL once it has scraped a cluster through LOAD_S seconds of load."""
    tmp = tmp_path_factory.mktemp("prometheus")
    model = tiny_model("llama")
    with launched(model, 1, 1, log_dir=tmp) as cluster:
        prometheus_config(cluster.metrics_urls(), tmp / "prometheus.yml")
        base = f"http://127.0.0.1:{free_port()}"
        log = open(tmp / "prometheus.log", "w")
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'data'}",
                                 f"--web.listen-address={base[len('http://'):]}"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: httpx.get(f"{base}/-/ready", timeout=1).status_code == 200,
                     30, "Prometheus not ready", tmp / "prometheus.log", proc)
            stop, sent = threading.Event(), []
            workers = [threading.Thread(target=load, args=(cluster.http_url, model.name,
                                                           stop, sent)) for _ in range(2)]
            for w in workers:
                w.start()
            time.sleep(LOAD_S)
            stop.set()
            for w in workers:
                w.join(timeout=30)
            assert sent, "no request got through:\n" + cluster.log()[-3000:]

            def scraped_everything():   # a scrape after the last request, of every target
                total = query(base, "sum(pdserve_requests_total)")
                up = query(base, 'sum(up{job=~"pdserve-.*"})')
                return total and float(total[0]["value"][1]) == len(sent) and \
                    up and float(up[0]["value"][1]) == 3
            wait_for(scraped_everything, 15, f"Prometheus never saw all {len(sent)} requests",
                     tmp / "prometheus.log", proc)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def wait_for(check, timeout_s: float, what: str, log_path: Path, proc) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"Prometheus exited ({proc.returncode}):\n"
                               + log_path.read_text()[-3000:])
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} within {timeout_s:g} s:\n" + log_path.read_text()[-3000:])


@needs_prometheus
def test_every_dashboard_and_alert_query_returns_data(prometheus):
    exprs = dashboard_exprs() + [(f"alert {r['alert']}", measurement(r["expr"]))
                                 for r in rules()]
    assert len(exprs) >= 30

    def without_data() -> list[str]:
        empty = []
        for where, expr in exprs:
            values = [float(series["value"][1]) for series in query(prometheus, expr)]
            if not any(math.isfinite(v) for v in values):
                empty.append(f"{where}: {expr} -> {values}")
        return empty
    # A rate needs two samples of its series in the window. On a loaded 2-core machine a
    # scrape can miss its 1 s timeout, so the second sample of a node's series can come a
    # few scrapes later than the fixture's check; an expression that never gets data still
    # fails here, after SETTLE_S.
    deadline = time.monotonic() + SETTLE_S
    empty = without_data()
    while empty and time.monotonic() < deadline:
        time.sleep(1.0)
        empty = without_data()
    assert not empty, "queries without data:\n" + "\n".join(empty)


@needs_prometheus
def test_prometheus_loads_the_alert_rules(prometheus):
    """The rules Prometheus evaluates are ours, and it evaluates them without error."""
    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(loaded) == {r["alert"] for r in rules()}
    bad = {n: r.get("lastError") for n, r in loaded.items() if r.get("health") == "err"}
    assert not bad, bad
