"""The ML venv stage alone, as deploy.py runs it (a deploy file for bench/venv_cache.py).

    pyinfra -y inventory/sandbox.py bench/venv_stage.py
"""

from pyinfra import host, inventory

from operations.mlenv import mlenv
from operations.plan import stop_if_refused
from operations.settings import for_inventory

settings = for_inventory((h.name, h.data.dict()) for h in inventory)[host.name]

mlenv(settings)
stop_if_refused()
