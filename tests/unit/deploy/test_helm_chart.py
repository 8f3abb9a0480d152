"""The Helm chart (deploy/helm/kvidx) lints and renders, for one and four replica groups, into
manifests that agree with its values: the config file's groups, the service sets' --groups, the topic
partitions, ports and probes; and it refuses values that cannot work. Needs a helm binary: on PATH, in
.venv/bin, or built there from Helm's Go module on this test's first run where Go is installed (a few
minutes, once; it says so); skipped otherwise, except in CI (KVIDX_REQUIRE_HELM=1: then it fails)."""

import fcntl
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from kvidx.config import load_config
from tests.helpers import ROOT

CHART = ROOT / "deploy" / "helm" / "kvidx"
HELM_VERSION = "v3.22.0"
VENV_BIN = ROOT / ".venv" / "bin"
HELM: str | None = None  # set by the `helm_binary` fixture below


def _found() -> str | None:
    return shutil.which("helm") or (str(VENV_BIN / "helm") if (VENV_BIN / "helm").exists() else None)


@pytest.fixture(scope="module", autouse=True)
def helm_binary(pytestconfig):
    """helm on PATH or in .venv/bin; else built into .venv/bin from its Go module (the Go module proxy is
    reachable where chart registries are not), once, under a lock (two pytest-xdist workers may ask)."""
    global HELM
    required = os.environ.get("KVIDX_REQUIRE_HELM") == "1"
    if _found() is None:
        go = shutil.which("go")
        if go is None:
            if required:
                pytest.fail("KVIDX_REQUIRE_HELM=1 but no helm binary and no Go to build it from its module")
            pytest.skip("no helm binary and no Go to build one: install either to run the chart test")
        VENV_BIN.mkdir(parents=True, exist_ok=True)
        with open(VENV_BIN / ".helm-build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _found() is None:
                capture = pytestconfig.pluginmanager.getplugin("capturemanager")
                with capture.global_and_fixture_disabled():
                    print(f"\n[test_helm_chart] building helm {HELM_VERSION} from its Go module into "
                          ".venv/bin (the chart test's first run only; a few minutes) ...",
                          file=sys.stderr, flush=True)
                r = subprocess.run([go, "install", f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}"],
                                   env={**os.environ, "GOBIN": str(VENV_BIN)}, capture_output=True,
                                   text=True, timeout=1800)
                if r.returncode != 0:
                    message = f"helm {HELM_VERSION} did not build from its Go module:\n{r.stderr[-2000:]}"
                    if required:
                        pytest.fail(message)
                    pytest.skip(message)
    HELM = _found()
    return HELM

FOUR = {
    "kafka": {"bootstrap": "my-cluster-kafka-bootstrap.kafka:9092", "partitions": 8,
              "topicPrefix": "prod.", "replicationFactor": 3, "minInsyncReplicas": 2},
    "config": {"models": [{"name": "llama-3-70b", "replicaGroups": 4},
                          {"name": "small", "replicaGroups": 1}]},
    "worker": {"replicas": 2},
    "service": {"port": 8181, "sets": [{"name": "a", "groups": "0,1", "replicas": 2},
                                       {"name": "b", "groups": "2,3", "replicas": 2}]},
    "relays": [{"name": "node-a", "engine": "vllm", "model": "llama-3-70b",
                "endpoint": "tcp://node-a:5557", "replayEndpoint": "tcp://node-a:5558"}],
}


def helm(*args: str, values: dict | None = None, tmp: Path | None = None) -> subprocess.CompletedProcess:
    assert HELM is not None, "the helm_binary fixture found or built it"
    extra = []
    if values is not None:
        f = tmp / "values.yaml"
        f.write_text(yaml.safe_dump(values))
        extra = ["-f", str(f)]
    return subprocess.run([HELM, *args, str(CHART), *extra], capture_output=True, text=True, timeout=120)


def render(values: dict | None, tmp: Path) -> list[dict]:
    r = helm("template", "kv", values=values, tmp=tmp)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def _arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize("values", [None, FOUR], ids=["defaults-G1", "G4"])
def test_lints_and_renders_what_the_values_say(values, tmp_path):
    lint = helm("lint", values=values, tmp=tmp_path)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = render(values, tmp_path)
    want = values or yaml.safe_load((CHART / "values.yaml").read_text())
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    (cm,) = by_kind["ConfigMap"]
    toml = tomllib.loads(cm["data"]["kvidx.toml"])
    rendered = tmp_path / "kvidx.toml"
    rendered.write_text(cm["data"]["kvidx.toml"])
    config = load_config(rendered)  # what every kvidx process will read: accepted as it is
    models = want["config"]["models"]
    assert all(config.model(m["name"]).replica_groups == m.get("replicaGroups", 1) for m in models)
    assert {m: c["replica_groups"] for m, c in toml["models"].items()} == \
        {m["name"]: m.get("replicaGroups", 1) for m in want["config"]["models"]}
    max_groups = max(m.get("replicaGroups", 1) for m in want["config"]["models"])
    partitions = str(want["kafka"]["partitions"])
    port = (want.get("service") or {}).get("port", 8080)
    held: set[int] = set()
    services = [d for d in by_kind["Deployment"]
                if d["metadata"]["labels"]["app.kubernetes.io/component"] == "service"]
    assert len(services) == len(want["service"]["sets"])
    for d in services + by_kind["StatefulSet"] + [x for x in by_kind["Deployment"] if x not in services]:
        (c,) = d["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["KVIDX_TOPIC_PARTITIONS"] == partitions
        for key, var in (("replicationFactor", "KVIDX_TOPIC_REPLICATION"),
                         ("minInsyncReplicas", "KVIDX_MIN_INSYNC_REPLICAS")):  # unset: the cluster's
            assert env.get(var) == (str(want["kafka"][key]) if want["kafka"].get(key) else None)
        assert env["KAFKA_BOOTSTRAP_SERVERS"] == want["kafka"]["bootstrap"]
        assert "--config" in c["args"] and _arg(c["args"], "--config") == "/etc/kvidx/kvidx.toml"
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == c["ports"][0]["containerPort"]
    for d in services:
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert c["args"][0] == "serve"
        assert int(_arg(c["args"], "--port")) == port == c["ports"][0]["containerPort"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
        groups = _arg(c["args"], "--groups")
        held |= set(range(max_groups)) if groups is None else {int(g) for g in groups.split(",")}
    assert held == set(range(max_groups))  # every group is held by some set
    (svc,) = by_kind["Service"]
    assert svc["spec"]["ports"][0]["port"] == port
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "service"
    (worker,) = by_kind["StatefulSet"]
    assert worker["spec"]["replicas"] == want["worker"]["replicas"]
    (wc,) = worker["spec"]["template"]["spec"]["containers"]
    assert wc["args"][0] == "worker"
    assert int(_arg(wc["args"], "--metrics-port")) == wc["ports"][0]["containerPort"]
    relays = [d for d in by_kind["Deployment"] if d not in services]
    assert len(relays) == len(want.get("relays") or [])
    for d, r in zip(relays, want.get("relays") or [], strict=True):
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert _arg(c["args"], "--model") == r["model"] and _arg(c["args"], "--endpoint") == r["endpoint"]
        assert d["spec"]["replicas"] == 1


@pytest.mark.parametrize("change,message", [
    ({"kafka": {**FOUR["kafka"], "partitions": 2}}, "replicaGroups 4 is more than kafka.partitions 2"),
    ({"service": {"sets": [{"name": "a", "groups": "0,1", "replicas": 1}]}},
     "no service set holds replica group 2"),
    ({"service": {"sets": [{"name": "a", "groups": "0,1,2,3,7", "replicas": 1}]}}, "holds group 7"),
    ({"service": {"sets": [{"name": "a", "groups": "0-3", "replicas": 1}]}}, "groups"),  # values.schema.json
    ({"kafka": {**FOUR["kafka"], "partitions": 0}}, "partitions"),
])
def test_refuses_values_that_cannot_work(change, message, tmp_path):
    r = helm("template", "kv", values={**FOUR, **change}, tmp=tmp_path)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_credentials_secret_and_ops_port(tmp_path):
    """service.credentialsSecret mounts the Secret as a directory (its updates reach the pod: no subPath)
    and passes --auth-token-file; service.opsPort moves the probe and Prometheus to the open ops port."""
    service = {**FOUR["service"], "credentialsSecret": "kvidx-credentials", "opsPort": 9090}
    values = {**FOUR, "service": service}
    lint = helm("lint", values=values, tmp=tmp_path)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    services = [d for d in render(values, tmp_path) if d["kind"] == "Deployment"
                and d["metadata"]["labels"]["app.kubernetes.io/component"] == "service"]
    assert len(services) == 2
    for d in services:
        spec = d["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        path = _arg(c["args"], "--auth-token-file")
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "credentials"]
        assert "subPath" not in mount and path == mount["mountPath"] + "/credentials"
        (volume,) = [v for v in spec["volumes"] if v["name"] == "credentials"]
        assert volume["secret"]["secretName"] == "kvidx-credentials"
        assert _arg(c["args"], "--ops-port") == "9090"
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8181, "ops": 9090}
        assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "ops"}
        assert d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9090"
    plain = [d for d in render(FOUR, tmp_path) if d["kind"] == "Deployment"
             and d["metadata"]["labels"]["app.kubernetes.io/component"] == "service"][0]
    (c,) = plain["spec"]["template"]["spec"]["containers"]
    assert c["args"][0] == "serve" and "--auth-token-file" not in c["args"] and "--ops-port" not in c["args"]


def test_lookup_port(tmp_path):
    """service.lookupPort passes --lookup-port to every instance and opens it on the pods and the Service;
    a set holding only some groups cannot have it (kvidx serve refuses the combination)."""
    values = {**FOUR, "service": {"sets": [{"name": "all", "groups": "", "replicas": 2}], "lookupPort": 8081}}
    lint = helm("lint", values=values, tmp=tmp_path)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = render(values, tmp_path)
    (d,) = [d for d in docs if d["kind"] == "Deployment"
            and d["metadata"]["labels"]["app.kubernetes.io/component"] == "service"]
    (c,) = d["spec"]["template"]["spec"]["containers"]
    assert _arg(c["args"], "--lookup-port") == "8081"
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["lookup"] == 8081
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    assert {"name": "lookup", "port": 8081, "targetPort": "lookup"} in svc["spec"]["ports"]
    split = {**FOUR, "service": {**FOUR["service"], "lookupPort": 8081}}  # sets holding some groups
    r = helm("template", "kv", values=split, tmp=tmp_path)
    assert r.returncode != 0 and "service.lookupPort" in r.stderr, r.stderr
