"""Observability's settings: the metrics, Prometheus, the alert rules and Alertmanager."""

from __future__ import annotations

from dataclasses import dataclass

from operations.plans.settings_rules import _URL, _int_between, _Rule, _text, setting


@dataclass(frozen=True)
class ObservabilitySettings:
    """Observability's part of Settings (operations/plans/settings_schema.py)."""
    # Observability (operations/stages/observability.py): metrics, Prometheus, alert rules
    #: True/False: this router host runs the fleet's Prometheus or not; None: the first one does
    prometheus: bool | None = setting(
        None,
        _Rule(lambda v: v is None or isinstance(v, bool),
              "True (this router host runs the fleet's Prometheus), False, or None "
              "(the first host of the gpuhost_router group does)"),
        "on a router host: True runs the fleet's Prometheus there, False not; None: the first "
        "host of the gpuhost_router group runs it (docs/observability.md)")
    prometheus_port: int = setting(
        9090, _int_between(1024, 65535),
        "Prometheus' port on its host's loopback (its UI: an SSH tunnel)")
    prometheus_retention_days: int = setting(
        15,
        # Prometheus' own flags: --storage.tsdb.retention.time (its default 15d) and
        # --storage.tsdb.retention.size; both bound the disk it takes, whichever is reached first.
        _int_between(1, 3650),
        "days of metrics Prometheus keeps")
    prometheus_retention_gib: int = setting(
        10, _int_between(1, 10240),
        "GiB of disk Prometheus' data may take; the oldest data goes first")
    node_exporter_port: int = setting(
        9100, _int_between(1024, 65535),
        "the node exporter's port on a GPU host (its fleet address, or the loopback where "
        "Prometheus runs on the same host)")
    gpu_metrics_interval: int = setting(
        15, _int_between(5, 3600),
        "seconds between two readings of nvidia-smi for the GPU metrics (DCGM exporter's names)")
    alert_ttft_p99: float = setting(
        10.0,
        _Rule(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
              and 0 < v <= 3600, "a number of seconds above 0, at most 3600"),
        "seconds: a p99 time to first token above this fires SGLangTTFTHigh")
    alert_itl_p99: float = setting(
        0.5,
        _Rule(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
              and 0 < v <= 60, "a number of seconds above 0, at most 60"),
        "seconds: a p99 inter-token latency above this fires SGLangITLHigh")
    alert_kv_cache_usage: float = setting(
        0.95,
        _Rule(lambda v: isinstance(v, float) and 0.0 < v <= 1.0,
              "a float above 0, at most 1 (the share of the KV cache's "
              "tokens in use, sglang:token_usage)"),
        "share of the KV cache in use above which SGLangKVCacheNearFull fires")
    #: Where Alertmanager posts the alerts (its webhook receiver); None: no Alertmanager
    alert_webhook_url: str | None = setting(
        None,
        _text(_URL, "an http(s) URL that takes Alertmanager's webhook POSTs "
              "(its webhook_config url)", optional=True),
        "on the Prometheus host: Debian's Alertmanager posts every alert, firing and resolved, "
        "to this URL (a webhook receiver); None: no Alertmanager, the alerts stay in "
        "Prometheus' UI and API")
    alertmanager_port: int = setting(
        9093, _int_between(1024, 65535),
        "Alertmanager's port on the Prometheus host's loopback")
