"""The host's proxy (operations/proxy.py): /etc/environment read as pam_env reads it, host data
over it, what stays local, and how a failed download names its URL and proxy."""

import subprocess
import sys
from types import SimpleNamespace

from operations import proxy
from operations.settings import Settings

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
    files = proxy.__file__.rsplit("/", 1)[0] + "/files"
    run = subprocess.run(
        [sys.executable, f"{files}/model_fetch.py", "--repo", "org/model", "--revision", "main",
         "--dest", str(tmp_path / "m"), "--endpoint", "https://hub.example"],
        capture_output=True, text=True, env=env, timeout=120, check=False)
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("model download failed: "), line
    assert line.endswith("(the Hub at https://hub.example, through the proxy "
                         "http://127.0.0.1:9)"), line
