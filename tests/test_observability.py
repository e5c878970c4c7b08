"""operations/stages/observability.py: which host runs Prometheus, its targets from the inventory,
the node exporter's and Prometheus' command lines, their settings; the configuration and alert rules
through the real promtool (check config, check rules, test rules with input series)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest
import yaml

from operations.plans.settings import SettingsError, from_host_data
from operations.stages import fleet, observability

ROOT = Path(__file__).resolve().parents[1]


def settings(name: str, **data):
    data.setdefault("fleet_key_file", "/root/fleet.key")  # the fleet's planes (security.md)
    return from_host_data(name, {f"gpuhost_{k}": v for k, v in data.items()})


def router(name: str, **data):
    return settings(name, router_api_key_file="/root/router.key", **data)


def gated(address: str, **extra):
    return settings("h", server_host=address, fleet_address=address,
                    api_key_file="/root/key", **extra)


def render(template: str, context: dict) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ROOT / "templates"))
    return env.get_template(template).render(**context)


def three_hosts(**router_data):
    s = {"gpu1": gated("10.0.0.1", router_api_key_file="/root/router.key", **router_data),
         "gpu2": gated("10.0.0.2"),
         "gpu3": gated("10.0.0.3")}
    hosts = [("gpu1", ["gpuhost_router"]), ("gpu2", []), ("gpu3", [])]
    return fleet.plan(hosts, s), s


def cpu_router_fleet():
    s = {"gpu1": gated("10.0.0.1"), "gpu2": gated("10.0.0.2"),
         "r1": router("r1", serving=False, fleet_address="10.0.0.9"),
         "r2": router("r2", serving=False, fleet_address="10.0.0.10")}
    hosts = [("gpu1", []), ("gpu2", []), ("r1", ["gpuhost_router"]), ("r2", ["gpuhost_router"])]
    return fleet.plan(hosts, s), s


def test_prometheus_runs_on_the_first_router_host_by_default():
    planned, s = cpu_router_fleet()
    assert observability.prometheus_hosts(planned, s) == ("r1",)
    s["r1"] = router("r1", serving=False, fleet_address="10.0.0.9", prometheus=False)
    assert observability.prometheus_hosts(planned, s) == ("r2",)
    s["r2"] = router("r2", serving=False, fleet_address="10.0.0.10", prometheus=True)
    s["r1"] = router("r1", serving=False, fleet_address="10.0.0.9")
    assert observability.prometheus_hosts(planned, s) == ("r2",)
    # no router host: no Prometheus (the node exporters still read the GPUs, on the loopback)
    alone = {"gpu1": settings("gpu1")}
    assert observability.prometheus_hosts(fleet.plan([("gpu1", [])], alone), alone) == ()
    assert observability.node_listen("gpu1", alone, ()) == "127.0.0.1"


def test_prometheus_outside_the_router_group_is_refused():
    planned, s = cpu_router_fleet()
    s["gpu2"] = gated("10.0.0.2", prometheus=True)
    with pytest.raises(ValueError, match="host gpu2: gpuhost_prometheus = True is not allowed "
                       "outside the gpuhost_router group"):
        observability.prometheus_hosts(planned, s)


def test_targets_are_the_routers_workers_its_metrics_and_every_gpu_hosts_exporter():
    planned, s = three_hosts()
    on = observability.prometheus_hosts(planned, s)
    assert on == ("gpu1",)
    targets = observability.scrape_targets("gpu1", planned, s, on)
    # the servers at the URLs the router uses, but its own host's through its gate (the port
    # behind it is root's alone: the loopback guard refuses Prometheus' user there)
    assert targets["sglang"] == [
        {"targets": ["10.0.0.1:8000"],
         "labels": {"host": "gpu1", "worker_url": "http://127.0.0.1:30000"}},
        {"targets": ["10.0.0.2:8000"],
         "labels": {"host": "gpu2", "worker_url": "http://10.0.0.2:8000"}},
        {"targets": ["10.0.0.3:8000"],
         "labels": {"host": "gpu3", "worker_url": "http://10.0.0.3:8000"}}]
    assert targets["smg"] == [{"targets": ["127.0.0.1:29000"], "labels": {"host": "gpu1"}}]
    assert targets["node"] == [
        {"targets": ["127.0.0.1:9100"], "labels": {"host": "gpu1"}},
        {"targets": ["10.0.0.2:9100"], "labels": {"host": "gpu2"}},
        {"targets": ["10.0.0.3:9100"], "labels": {"host": "gpu3"}}]
    # each exporter listens where that Prometheus reaches it, and nowhere wider
    assert [observability.node_listen(n, s, on) for n in s] == [
        "127.0.0.1", "10.0.0.2", "10.0.0.3"]


def test_its_own_server_on_every_interface_is_scraped_at_the_gates_loopback_address():
    planned, s = three_hosts()
    s["gpu1"] = dataclasses.replace(s["gpu1"], server_host="0.0.0.0")
    targets = observability.scrape_targets("gpu1", planned, s, ("gpu1",))
    assert targets["sglang"][0]["targets"] == ["127.0.0.1:8000"]


def test_a_cpu_only_router_host_has_no_node_exporter_target():
    planned, s = cpu_router_fleet()
    targets = observability.scrape_targets("r1", planned, s, ("r1",))
    assert [g["labels"]["host"] for g in targets["node"]] == ["gpu1", "gpu2"]
    assert [g["targets"] for g in targets["sglang"]] == [["10.0.0.1:8000"], ["10.0.0.2:8000"]]


def test_command_lines():
    s = settings("gpu1", prometheus_port=9091, prometheus_retention_days=30,
                 prometheus_retention_gib=50, node_exporter_port=9101)
    assert observability.prometheus_args(s) == (
        "--config.file=/etc/prometheus/prometheus.yml --web.listen-address=127.0.0.1:9091 "
        "--web.config.file=/etc/prometheus/gpuhost-web.yml "
        "--storage.tsdb.retention.time=30d --storage.tsdb.retention.size=50GB")
    assert observability.node_exporter_args("10.0.0.2", s) == (
        "--web.listen-address=10.0.0.2:9101 "
        "--web.config.file=/etc/gpuhost/node-exporter-web.yml "
        "--collector.textfile.directory=/var/lib/prometheus/node-exporter --collector.systemd "
        "--collector.systemd.unit-include=(sglang|sglang-gate|gpuhost-gpu-metrics)[.]service "
        "--collector.systemd.enable-start-time-metrics")


@pytest.mark.parametrize(("data", "message"), [
    ({"prometheus_retention_days": 0},
     "gpuhost_prometheus_retention_days = 0 is not allowed: an integer from 1 to 3650"),
    ({"prometheus_retention_gib": "10GB"},
     "gpuhost_prometheus_retention_gib = '10GB' is not allowed: an integer from 1 to 10240"),
    ({"prometheus": "yes"}, "gpuhost_prometheus = 'yes' is not allowed: True"),
    ({"alert_ttft_p99": 0}, "gpuhost_alert_ttft_p99 = 0 is not allowed: a number of seconds"),
    ({"alert_kv_cache_usage": 1.5}, "gpuhost_alert_kv_cache_usage = 1.5 is not allowed"),
    ({"node_exporter_port": 8000}, "gpuhost_node_exporter_port = 8000 is not allowed: a port "
     "other than gpuhost_server_port's (8000)"),
    ({"prometheus_port": 29000}, "gpuhost_prometheus_port = 29000 is not allowed: a port other "
     "than the router's metrics (127.0.0.1)'s (29000)"),
    ({"prometheus_port": 9100}, "gpuhost_node_exporter_port = 9100 is not allowed: a port other "
     "than gpuhost_prometheus_port's (9100)"),
])
def test_bad_observability_settings_are_named(data, message):
    with pytest.raises(SettingsError) as err:
        settings("gpu1", **data)
    assert message in str(err.value)


def _rules_dir(tmp_path: Path, **data) -> Path:
    """The alert rules and the thresholds rendered from host data, with the promtool test."""
    s = settings("gpu1", **data)
    shutil.copy(ROOT / "templates" / "gpuhost-alerts.yml", tmp_path)
    shutil.copy(ROOT / "tests" / "promtool" / "gpuhost-alerts-test.yml", tmp_path)
    (tmp_path / "gpuhost-thresholds.yml").write_text(
        render("gpuhost-thresholds.yml.j2", observability.thresholds_context(s)))
    return tmp_path


def test_rules_pass_promtool_check_rules(promtool, tmp_path):
    d = _rules_dir(tmp_path)
    done = subprocess.run([promtool, "check", "rules", str(d / "gpuhost-alerts.yml"),
                           str(d / "gpuhost-thresholds.yml")], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 19 rules found" in done.stdout and "SUCCESS: 3 rules found" in done.stdout


def test_rules_pass_promtool_test_rules(promtool, tmp_path):
    """Each alert fires on its input series (a stopped server, a failed unit, the power cap the
    H200 hit under load, heat, a full KV cache, a growing queue, slow first tokens and tokens,
    a host the router lost) within its for:, and not on the healthy ones beside it."""
    d = _rules_dir(tmp_path)
    done = subprocess.run([promtool, "test", "rules", "gpuhost-alerts-test.yml"], cwd=d,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_thresholds_come_from_host_data(promtool, tmp_path):
    """With the TTFT target at 30 s, 10-20 s first tokens no longer fire: the test fails."""
    d = _rules_dir(tmp_path, alert_ttft_p99=30.0)
    done = subprocess.run([promtool, "test", "rules", "gpuhost-alerts-test.yml"], cwd=d,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1
    assert "alertname: SGLangTTFTHigh" in done.stdout + done.stderr
    assert "alertname: SGLangITLHigh" not in done.stdout + done.stderr


def test_prometheus_config_passes_promtool_check_config(promtool, tmp_path):
    planned, s = three_hosts()
    (tmp_path / "rules").mkdir()
    rules = _rules_dir(tmp_path / "rules")
    targets = tmp_path / "targets"
    targets.mkdir()
    for job, groups in observability.scrape_targets("gpu1", planned, s, ("gpu1",)).items():
        (targets / f"{job}.json").write_text(json.dumps(groups))
    context = {**observability.prometheus_context("gpu1", s["gpu1"]),
               "rules_dir": str(rules), "targets_dir": str(targets),
               "key_file": str(tmp_path / "fleet.key"),
               "password_file": str(tmp_path / "node.password")}
    text = render("prometheus.yml.j2", context)
    (tmp_path / "prometheus.yml").write_text(text)
    (rules / "gpuhost-alerts-test.yml").unlink()  # not a rule file

    def check():
        return subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                              capture_output=True, text=True, check=False)

    # promtool 2.42 checks that the credential files exist: the fields are its own
    first = check()
    assert first.returncode == 1 and "fleet.key: no such file" in first.stdout + first.stderr
    (tmp_path / "fleet.key").write_text("sk-fleet\n")
    (tmp_path / "node.password").write_text("derived\n")
    done = check()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 2 rule files found" in done.stdout
    # the servers' job sends the fleet key, the node exporters' the password; smg's neither
    jobs = {j["job_name"]: j for j in yaml.safe_load(text)["scrape_configs"]}
    assert jobs["sglang"]["authorization"] == {"type": "Bearer",
                                               "credentials_file": context["key_file"]}
    assert jobs["node"]["basic_auth"] == {"username": "prometheus",
                                          "password_file": context["password_file"]}
    assert "authorization" not in jobs["smg"] and "basic_auth" not in jobs["smg"]
    # Prometheus' own web admits the password alone: it scrapes itself with it
    assert jobs["prometheus"]["basic_auth"] == jobs["node"]["basic_auth"]
    assert "sk-" not in text


def test_gpu_metrics_units():
    context = observability.gpu_metrics_context(15, 8)
    service = render("gpuhost-gpu-metrics.service.j2", context)
    assert ("ExecStart=/usr/bin/python3 /opt/gpuhost/lib/gpu_metrics.py --output "
            "/var/lib/prometheus/node-exporter/gpuhost-gpu.prom --expected-gpus 8") in service
    assert "ReadWritePaths=/var/lib/prometheus/node-exporter" in service
    assert "OnUnitActiveSec=15s" in render("gpuhost-gpu-metrics.timer.j2", context)


def test_the_servers_info_series_names_the_locks_sglang(promtool):
    from tests.conftest import promtool_check_metrics

    s = settings("gpu1", served_model_name='glm-5.x')
    text = observability.server_info(s)
    assert 'gpuhost_server_info{served_model_name="glm-5.x",sglang="0.5.9"} 1\n' in text
    assert promtool_check_metrics(promtool, text) == []
    # Prometheus' text format escapes (exposition_formats.md): backslash, quote, newline
    assert observability._label('a"b\\c\nd') == 'a\\"b\\\\c\\nd'


def test_the_webhook_config_passes_amtool_and_prometheus_sends_to_it(amtool, promtool,
                                                                      tmp_path):
    s = settings("gpu1", alert_webhook_url="https://hooks.example.org/T0/abc?x=1&y='2'",
                 alertmanager_port=9193)
    text = render("gpuhost-alertmanager.yml.j2", {"host": "gpu1", "url": s.alert_webhook_url})
    (tmp_path / "am.yml").write_text(text)
    done = subprocess.run([amtool, "check-config", str(tmp_path / "am.yml")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    config = yaml.safe_load(text)
    assert config["receivers"][0]["webhook_configs"] == [
        {"url": s.alert_webhook_url, "send_resolved": True}]
    assert config["route"]["receiver"] == "webhook"
    assert observability.alertmanager_args(s) == (
        "--config.file=/etc/prometheus/gpuhost-alertmanager.yml "
        "--web.listen-address=127.0.0.1:9193 --cluster.listen-address=")
    context = observability.prometheus_context("gpu1", s)
    assert yaml.safe_load(render("prometheus.yml.j2", context))["alerting"] == {
        "alertmanagers": [{"static_configs": [{"targets": ["127.0.0.1:9193"]}]}]}
    # no webhook: no Alertmanager for Prometheus
    plain = observability.prometheus_context("gpu1", settings("gpu1"))
    assert "alerting" not in yaml.safe_load(render("prometheus.yml.j2", plain))


@pytest.mark.parametrize(("data", "message"), [
    ({"alert_webhook_url": "hooks.example.org/x"},
     "gpuhost_alert_webhook_url = 'hooks.example.org/x' is not allowed: an http(s) URL"),
    ({"alertmanager_port": 9100},
     "gpuhost_alertmanager_port = 9100 is not allowed: a port other than "
     "gpuhost_node_exporter_port's (9100): Alertmanager listens there"),
])
def test_bad_webhook_settings_are_named(data, message):
    with pytest.raises(SettingsError) as err:
        settings("gpu1", **data)
    assert message in str(err.value)
