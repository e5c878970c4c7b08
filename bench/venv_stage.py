"""The ML venv stage alone, as deploy.py runs it (a deploy file for bench/venv_cache.py).

    pyinfra -y inventory/sandbox.py bench/venv_stage.py
"""

from pyinfra import host, inventory

from operations.plans.plan import stop_if_refused
from operations.plans.settings import for_inventory
from operations.stages.mlenv import mlenv

settings = for_inventory((h.name, h.data.dict()) for h in inventory)[host.name]

mlenv(settings)
stop_if_refused()
