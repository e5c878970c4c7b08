"""The host's proxy (operations/plans/proxy.py): /etc/environment read as pam_env reads it, host
data over it, what stays local, and how a failed download names its URL and proxy."""

import subprocess
import sys
from types import SimpleNamespace

from pyinfra.api import Config, FactBase, Inventory, State
from pyinfra.api import host as host_module
from pyinfra.api.host import Host
from pyinfra.api.state import StateStage
from pyinfra.context import ctx_host, ctx_state
from pyinfra.facts.server import Command

from operations.runtime import fact_cache
from operations.plans import proxy
from operations.plans.settings import Settings

ETC_ENVIRONMENT = """\
PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
# the lab's proxy
  export HTTPS_PROXY=http://proxy.lab:3128
http_proxy='http://proxy.lab:3128'  # trailing comment
HTTP_PROXY=http://other:1
no_proxy=.lab,10.0.0.0/8
bad-key=x
"""


def test_etc_environment_as_pam_env_reads_it():
    assert proxy.parse_environment(ETC_ENVIRONMENT) == {
        "https_proxy": "http://proxy.lab:3128",
        "http_proxy": "http://proxy.lab:3128",  # the lower-case spelling wins, as curl's
        "no_proxy": ".lab,10.0.0.0/8",
    }
    assert proxy.parse_environment("") == {}
    assert proxy.parse_environment("#http_proxy=http://p:1\n") == {}


def test_host_data_wins_and_both_spellings_are_set():
    s = Settings(proxy="http://proxy.example.com:3128")
    chosen = proxy.host_proxy(s, {"http_proxy": "http://env:1", "no_proxy": ".lab"},
                              ["10.0.0.11"])
    assert chosen.source == "gpuhost_proxy"
    env = chosen.env()
    assert env["http_proxy"] == env["HTTPS_PROXY"] == "http://proxy.example.com:3128"
    assert env["no_proxy"] == env["NO_PROXY"] == "localhost,127.0.0.1,::1,10.0.0.11,.lab"


def test_etc_environment_when_host_data_names_none():
    chosen = proxy.host_proxy(Settings(), {"https_proxy": "http://p:8080"}, [])
    assert (chosen.http, chosen.https, chosen.source) == (None, "http://p:8080",
                                                          "/etc/environment")
    assert "http_proxy" not in chosen.env() and chosen.env()["https_proxy"] == "http://p:8080"
    assert proxy.host_proxy(Settings(), {}, ["10.0.0.11"]).env() == {}


def test_the_fleet_stays_local():
    fleet = {"gpu1": Settings(fleet_address="10.0.0.11", server_host="10.0.0.11",
                              router_host="10.0.0.11"),
             "gpu2": Settings(fleet_address="10.0.0.12")}
    hosts = [SimpleNamespace(name="gpu1", data={"ssh_hostname": "203.0.113.11"}),
             SimpleNamespace(name="gpu2.lab", data={}),
             SimpleNamespace(name="@local", data={})]
    assert proxy.local_names(fleet, hosts) == ["10.0.0.11", "10.0.0.12", "203.0.113.11",
                                               "gpu2.lab"]


def test_through_names_the_proxy_a_url_takes():
    chosen = proxy.Proxy("http://p:3128", "https://u@q:8443", ("localhost", ".lab", "10.0.0.11"),
                         "gpuhost_proxy")
    assert proxy.through(chosen, "http://nvidia.example/k.gpg") == "through the proxy http://p:3128"
    assert proxy.through(chosen, "https://hub.example/x") == "through the proxy https://q:8443"
    assert proxy.through(chosen, "http://mirror.lab/x") == "directly, through no proxy"
    assert proxy.through(chosen, "http://10.0.0.11:8000/") == "directly, through no proxy"
    assert proxy.through(proxy.Proxy(None, None, (), "x"), "http://a/") == \
        "directly, through no proxy"


def test_model_fetch_names_the_hub_and_its_proxy(tmp_path):
    """A Hub that cannot be reached: the line names the endpoint and the proxy the request
    took (a dead one), not only the exception's type."""
    env = {"PATH": "/usr/bin:/bin", "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": "localhost",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    files = proxy.__file__.rsplit("/", 2)[0] + "/files"
    run = subprocess.run(
        [sys.executable, f"{files}/model_fetch.py", "--repo", "org/model", "--revision", "main",
         "--dest", str(tmp_path / "m"), "--endpoint", "https://hub.example"],
        capture_output=True, text=True, env=env, timeout=120, check=False)
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("model download failed: "), line
    assert line.endswith("(the Hub at https://hub.example, through the proxy "
                         "http://127.0.0.1:9)"), line


class _SeenProxy(FactBase):
    """The proxy a command of the host sees, as a fact that reaches the outside would."""

    reaches_outside = True

    def command(self) -> str:
        return "echo ${https_proxy:-none}"

    def process(self, output):
        return output[0]


def test_facts_read_before_the_proxy_was_known_are_read_again_through_it(monkeypatch):
    """/etc/environment's proxy is read in one batch with the last run's recorded facts: once
    it is known, a fact that reaches the outside answers again, with it; the others are kept.
    pyinfra's own State, Host and @local connector; each reading a real command here."""
    monkeypatch.setattr(host_module, "get_fact", host_module.get_fact)
    for name in ("run_shell_command", "put_file"):
        monkeypatch.setattr(Host, name, getattr(Host, name))
    monkeypatch.delattr(host_module, "_gpuhost_fact_cache", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    state.current_stage = StateStage.Prepare
    local = inventory.get_host("@local")
    with ctx_state.use(state), ctx_host.use(local):
        local.connect()
        fact_cache.install()
        assert local.get_fact(_SeenProxy) == "none"
        assert local.get_fact(Command, "echo ${https_proxy:-none}") == "none"
        chosen = proxy.use_host_proxy(Settings(), {}, [],
                                      environment={"https_proxy": "http://p.lab:3128"})
        assert chosen.source == "/etc/environment"
        assert local.get_fact(_SeenProxy) == "http://p.lab:3128"
        assert local.get_fact(Command, "echo ${https_proxy:-none}") == "none"  # kept
        assert proxy.of_host() is chosen
