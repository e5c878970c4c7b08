"""pyinfra's floor for bench/noop_deploy.py: a deploy of one operation (``true`` on the host,
through the same inventory, login and sudo as deploy.py), nothing of gpuhost's."""

from pyinfra.operations import server

server.shell(name="true", commands=["true"])
