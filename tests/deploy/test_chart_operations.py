"""Day-2 parts of the chart: drain timeouts and termination grace per role, every pod's own metrics
port and the PodMonitor that scrapes it, the Grafana dashboard (its queries against the metric names
the services really register), KEDA's queue-based autoscaling of the schedulers."""

from __future__ import annotations

import json
import re
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry

from pdserve.observability import rpc_observer
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.services.detokenizer.metrics import DetokenizerMetrics
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.routing.discovery import parse_dns_target
from tests.deploy.conftest import NAMESPACE, Rendered, load_values, render

DRAINING = ("gateway", "prefill", "decode")  # the roles with a --drain-timeout


def test_each_draining_role_gets_its_drain_timeout_and_a_longer_grace(rendered: Rendered) -> None:
    for component in DRAINING:
        if f"llm-pdserve-{component}" not in rendered.workloads():
            continue  # prefill with 0 replicas is not deployed
        drain = rendered.values.get(component, {}).get("drainTimeoutSeconds", 30)
        assert rendered.env(component)["PDSERVE_DRAIN_TIMEOUT"] == str(drain)
        grace = rendered.workload(component)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace == drain + 15, component
    for component in ("tokenizer", "detokenizer"):
        assert "PDSERVE_DRAIN_TIMEOUT" not in rendered.env(component)


def test_an_explicit_grace_period_wins_and_drains_follow_their_values() -> None:
    chart = render(
        load_values(
            "default",
            {
                "gateway": {"drainTimeoutSeconds": 120},
                "decode": {"drainTimeoutSeconds": 10, "terminationGracePeriodSeconds": 300},
            },
        )
    )
    assert chart.env("gateway")["PDSERVE_DRAIN_TIMEOUT"] == "120"
    assert chart.workload("gateway")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 135
    assert chart.env("decode")["PDSERVE_DRAIN_TIMEOUT"] == "10"
    assert chart.workload("decode")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 300


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions with In) against ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def test_pod_monitor_scrapes_the_metrics_port_of_every_pdserve_pod() -> None:
    chart = render(load_values("gpu-pd", {"podMonitor": {"enabled": True, "labels": {"release": "kp"}}}))
    (monitor,) = chart.kind("PodMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kp"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert spec["podTargetLabels"] == ["app.kubernetes.io/instance", "app.kubernetes.io/component"]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("metrics", "/metrics", "15s")
    port = chart.values.get("metrics", {}).get("port", 9400)
    workloads = chart.workloads()
    assert len(workloads) == 5  # gpu-pd deploys every role
    for name, workload in workloads.items():
        pod = workload["spec"]["template"]
        assert selects(spec["selector"], pod["metadata"]["labels"]), name
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == port, name
        component = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        assert chart.env(component)["PDSERVE_METRICS_PORT"] == str(port)
    for pod in chart.kind("Pod").values():  # helm test's pod serves no metrics
        assert not selects(spec["selector"], pod["metadata"].get("labels", {}))


def test_pod_monitor_is_off_by_default_and_network_policies_admit_the_scrapes(rendered: Rendered) -> None:
    assert rendered.kind("PodMonitor") == {}
    chart = render(load_values("default", {"networkPolicy": {"enabled": True}, "metrics": {"port": 9500}}))
    for name, policy in chart.kind("NetworkPolicy").items():
        open_ports = [
            p["port"] for rule in policy["spec"]["ingress"] if "from" not in rule for p in rule["ports"]
        ]
        assert 9500 in open_ports, name


def prometheus_label(pod_label: str) -> str:
    """The label Prometheus gives a pod label it copies (``podTargetLabels``): ``/.-`` become ``_``."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", pod_label)


def registered_series() -> set[str]:
    """Every series name the services' registries can expose."""
    rpc_observer._metrics()  # the process-wide RPC metrics every service registers
    return queryable_names(
        SchedulerMetrics("decode", "m").registry,
        GatewayMetrics("m").registry,
        DetokenizerMetrics("m").registry,
        REGISTRY,
    )


def queryable_names(*registries: CollectorRegistry) -> set[str]:
    """The series names PromQL sees for ``registries``' families (counters with ``_total``,
    histograms' ``_bucket``/``_sum``/``_count``)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {
        family.name + suffix
        for registry in registries
        for family in registry.collect()
        for suffix in suffixes[family.type]
    }


def test_dashboard_config_map_queries_only_metrics_the_services_register() -> None:
    chart = render(
        load_values("gpu-pd", {"grafanaDashboard": {"enabled": True}, "podMonitor": {"enabled": True}})
    )
    config_map = chart.kind("ConfigMap")["llm-pdserve-dashboard"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["pdserve.json"])
    panels = dashboard["panels"]
    titles = " | ".join(p["title"] for p in panels)
    for topic in (
        "first token",
        "Inter-token",
        "throughput",
        "Queue",
        "KV cache usage",
        "hit rate",
        "transfer",
    ):
        assert topic in titles, topic
    registered = registered_series()
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {name for expr in exprs for name in re.findall(r"pdserve:[a-zA-Z0-9_:]+", expr)}
    assert len(used) >= 15
    assert used <= registered, f"not registered by any service: {sorted(used - registered)}"
    # the role label the panels split by is the PodMonitor's pod target label, as Prometheus names it
    (monitor,) = chart.kind("PodMonitor").values()
    role = prometheus_label(monitor["spec"]["podTargetLabels"][-1])
    assert role == "app_kubernetes_io_component" and sum(role in expr for expr in exprs) >= 5
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]


def test_dashboard_is_off_by_default(rendered: Rendered) -> None:
    assert "llm-pdserve-dashboard" not in rendered.kind("ConfigMap")


def test_keda_scales_each_scheduler_statefulset_on_queue_depth_and_kv_usage() -> None:
    autoscaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 6, "queueDepthTarget": 3}
    chart = render(
        load_values(
            "gpu-pd",
            {
                "podMonitor": {"enabled": True},
                "prefill": {"autoscaling": autoscaling},
                "decode": {"autoscaling": autoscaling},
            },
        )
    )
    registered = registered_series()
    scaled = chart.kind("ScaledObject")
    assert sorted(scaled) == ["llm-pdserve-decode", "llm-pdserve-prefill"]
    for component in ("prefill", "decode"):
        obj = scaled[f"llm-pdserve-{component}"]
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        spec = obj["spec"]
        target = spec["scaleTargetRef"]
        workload = chart.kind(target["kind"])[target["name"]]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "StatefulSet")
        assert "replicas" not in workload["spec"]  # KEDA owns it; helm upgrade must not reset it
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 6)
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        queries = {}
        for trigger in spec["triggers"]:
            assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
            meta = trigger["metadata"]
            assert meta["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
            queries[trigger["name"]] = (meta["query"], float(meta["threshold"]))
            (name,) = re.findall(r"pdserve:[a-zA-Z0-9_:]+", meta["query"])
            assert name in registered
            # the query's label matchers select this StatefulSet's pods, as the PodMonitor labels them
            matchers = dict(re.findall(r'(\w+)="([^"]*)"', meta["query"]))
            assert matchers.pop("namespace") == NAMESPACE
            assert matchers == {
                prometheus_label(k): v for k, v in pod_labels.items() if prometheus_label(k) in matchers
            }
            assert set(matchers) == {"app_kubernetes_io_instance", "app_kubernetes_io_component"}
        assert queries["queue-depth"][1] == 3 and "num_queue_reqs" in queries["queue-depth"][0]
        assert queries["kv-usage"][1] == 0.9 and "kv_cache_usage_perc" in queries["kv-usage"][0]
        # the gateway follows the pods through the headless Service's DNS name
        host, port = parse_dns_target(chart.env("gateway")[f"PDSERVE_{component.upper()}_ADDRESSES"])
        service = chart.kind("Service")[f"llm-pdserve-{component}"]
        assert host == f"{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
        assert service["spec"]["clusterIP"] == "None"
        assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels)
        assert port == workload["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]


def test_hpa_controller_scales_each_scheduler_on_custom_per_pod_metrics() -> None:
    """``controller: hpa``: an autoscaling/v2 HPA per scheduler StatefulSet on the per-pod custom
    metrics that prometheus-adapter serves from our series (pdserve:<name> -> pdserve_<name>)."""
    autoscaling = {"enabled": True, "controller": "hpa", "minReplicas": 2, "maxReplicas": 5}
    chart = render(
        load_values(
            "gpu-pd",
            {
                "podMonitor": {"enabled": True},
                "prefill": {"autoscaling": autoscaling},
                "decode": {"autoscaling": {**autoscaling, "kvUsageTarget": 0.8}},
            },
        )
    )
    assert chart.kind("ScaledObject") == {}
    registered = registered_series()
    hpas = chart.kind("HorizontalPodAutoscaler")
    for component, kv_target in (("prefill", "0.9"), ("decode", "0.8")):
        hpa = hpas[f"llm-pdserve-{component}"]
        assert hpa["apiVersion"] == "autoscaling/v2"
        spec = hpa["spec"]
        target = spec["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "StatefulSet")
        assert "replicas" not in chart.kind("StatefulSet")[target["name"]]["spec"]  # the HPA owns it
        assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 5)
        targets = {}
        for metric in spec["metrics"]:
            assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
            name = metric["pods"]["metric"]["name"]
            assert name.replace("pdserve_", "pdserve:", 1) in registered
            targets[name] = metric["pods"]["target"]["averageValue"]
        assert targets == {"pdserve_num_queue_reqs": "4", "pdserve_kv_cache_usage_perc": kv_target}
        host, _ = parse_dns_target(chart.env("gateway")[f"PDSERVE_{component.upper()}_ADDRESSES"])
        assert host.startswith(f"llm-pdserve-{component}.")


def test_without_autoscaling_the_gateway_lists_fixed_pods(rendered: Rendered) -> None:
    assert rendered.kind("ScaledObject") == {}
    decode = rendered.env("gateway")["PDSERVE_DECODE_ADDRESSES"]
    assert (
        not decode.startswith("dns:")
        and decode.count(",") == rendered.workload("decode")["spec"]["replicas"] - 1
    )


def test_log_format_and_tracing_reach_every_role() -> None:
    chart = render(
        load_values("gpu-pd", {"logFormat": "json", "tracing": {"otlpEndpoint": "http://otel:4317"}})
    )
    for component in ("gateway", "tokenizer", "detokenizer", "prefill", "decode"):
        env = chart.env(component)
        assert (env["PDSERVE_LOG_FORMAT"], env["PDSERVE_OTLP_TRACES_ENDPOINT"]) == (
            "json",
            "http://otel:4317",
        )
    assert "PDSERVE_OTLP_TRACES_ENDPOINT" not in render(load_values("default")).env("decode")


def test_a_hub_model_is_downloaded_by_every_role_into_the_cache_with_its_token() -> None:
    """``model.hub``: no HF_HUB_OFFLINE, $HF_HOME on the cache volume, the revision as --revision,
    and $HF_TOKEN from the Secret's key in every role; without it every role stays offline."""
    hub = {"enabled": True, "revision": "v1.2", "tokenSecret": {"name": "hf", "key": "tok"}}
    chart = render(load_values("gpu-pd", {"model": {"name": "org/some-model", "hub": hub}}))
    offline = render(load_values("gpu-pd"))
    for component in ("gateway", "tokenizer", "detokenizer", "prefill", "decode"):
        env = chart.env(component)
        assert "HF_HUB_OFFLINE" not in env
        assert (env["PDSERVE_MODEL"], env["PDSERVE_REVISION"]) == ("org/some-model", "v1.2")
        mounts = {m["mountPath"] for m in chart.container(component)["volumeMounts"]}
        assert env["HF_HOME"] == f"{env['PDSERVE_CACHE_DIR']}/huggingface"
        assert env["PDSERVE_CACHE_DIR"] in mounts
        token = {e["name"]: e.get("valueFrom") for e in chart.container(component)["env"]}["HF_TOKEN"]
        assert token == {"secretKeyRef": {"name": "hf", "key": "tok"}}
        assert offline.env(component)["HF_HUB_OFFLINE"] == "1"
        assert "HF_TOKEN" not in {e["name"] for e in offline.container(component)["env"]}
