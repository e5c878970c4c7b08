"""Facts about NVIDIA GPUs and their driver, read from nvidia-smi on the host."""

from __future__ import annotations

from pyinfra.api import FactBase
from pyinfra.api.exceptions import FactProcessError
from typing_extensions import override

from operations.facts.nvsmi import QUERY_FIELDS, DriverState, ParseError, parse_driver_state


class NvidiaDriver(FactBase[DriverState]):
    """The driver as nvidia-smi sees it, and the GPUs when it answers.

    .. code:: python

        DriverState(status="ok", driver_version="580.159.04", gpus=(Gpu(index=0,
            name="NVIDIA H200", memory_mib=143771, compute_capability="9.0", ...),))

    Tolerates a host without nvidia-smi (``status="absent"``): facts are read before the
    driver is installed.
    """

    @override
    def command(self) -> str:
        fields = ",".join(QUERY_FIELDS)
        return (
            "if command -v nvidia-smi >/dev/null 2>&1; then "
            f"nvidia-smi --query-gpu={fields} --format=csv,noheader,nounits 2>&1; "
            'echo "rc=$?"; else echo rc=127; fi'
        )

    @override
    def process(self, output: list[str]) -> DriverState:
        try:
            return parse_driver_state(list(output))
        except ParseError as exc:
            raise FactProcessError(str(exc)) from exc
