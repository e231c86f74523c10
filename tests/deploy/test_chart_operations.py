"""Day-2 parts of the chart: drain timeouts and termination grace per role."""

from __future__ import annotations

from tests.deploy.conftest import Rendered, load_values, render

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
