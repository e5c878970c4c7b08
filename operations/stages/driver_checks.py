"""Checks of a host's kernel and driver: headers, DKMS's module, the loaded driver, GPU binding."""

from __future__ import annotations

import re

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import OperationError, OperationValueError

from operations.runtime import remote
from operations.facts.driver_facts import DKMS_MODULE, PciGpu, PciGpus, parse_lspci

@operation(is_idempotent=False)
def driver_answers(module_package: str, gpu_count: int):
    """Check, after a reboot, that nvidia-smi answers, that the loaded driver is the installed
    ``module_package``'s version, and that it lists ``gpu_count`` GPUs. Fails the host
    otherwise, so that nothing after it (the server) runs on a driver that does not match.

    + module_package: the package whose version the loaded driver must have
    + gpu_count: the GPUs nvidia-smi must list
    """
    yield StringCommand(_answers_command(module_package, gpu_count))


def _answers_command(module_package: str, gpu_count: int) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", module_package):
        raise OperationValueError(f"package name {module_package!r}")
    return (
        "v=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1) "
        "|| { echo \"nvidia-smi fails: $v\" >&2; exit 1; }; v=$(echo \"$v\" | head -n 1); "
        f"p=$(dpkg-query -W -f='${{Version}}' {module_package}); "
        "case \"$p\" in \"$v\"-*) ;; *) echo \"loaded driver $v, installed $p\" >&2; exit 1;; esac; "
        "n=$(nvidia-smi -L | grep -c '^GPU '); "
        f"if [ \"$n\" -ne {int(gpu_count)} ]; then "
        f"echo \"nvidia-smi lists $n GPU(s), {int(gpu_count)} expected\" >&2; exit 1; fi; "
        "echo \"driver $v loaded, $n GPU(s)\""
    )


def driver_failure(host, module_package: str, gpu_count: int) -> str | None:
    """Run, from an operation's callback, the checks of :func:`driver_answers` and
    :func:`gpus_bound`; the first failure in words ("nvidia-smi fails: NVIDIA-SMI has failed
    because it couldn't communicate with the NVIDIA driver. ..."), or None when the driver
    passes them all."""
    ok, out = remote.shell(host, _answers_command(module_package, gpu_count))
    if not ok:
        return "; ".join(line for line in out.stderr_lines if line.strip()) or "nvidia-smi fails"
    _status, out = remote.shell(host, PciGpus().command())
    return binding_failure(parse_lspci(out.stdout_lines))


def binding_failure(gpus: tuple[PciGpu, ...] | None) -> str | None:
    """Why the GPUs :class:`PciGpus` read are not all bound to nvidia, or None when they are."""
    if gpus is None:
        return "lspci is not installed (pciutils): cannot check GPU binding"
    wrong = [f"{g.address} ({g.driver or 'no driver'})" for g in gpus if g.driver != "nvidia"]
    if wrong:
        return f"GPUs not bound to nvidia: {', '.join(wrong)}"
    return None if gpus else "lspci lists no NVIDIA GPU"


@operation(is_idempotent=False)
def gpus_bound():
    """Check that every NVIDIA GPU on the PCI bus is bound to the nvidia driver (``lspci -Dnnk``,
    see :class:`PciGpus`); raises OperationError naming each GPU bound elsewhere or unbound."""

    @remote.callback("the GPU binding check")
    def check(state, host):
        _status, out = remote.shell(host, PciGpus().command())
        gpus = parse_lspci(out.stdout_lines)
        failure = binding_failure(gpus)
        if failure:
            raise OperationError(failure)
        logger.info(f"{host.print_prefix}{len(gpus or ())} GPU(s) bound to nvidia")
        return True

    yield FunctionCommand(check, (), {})


@operation(is_idempotent=False)
def headers_installable(kernel: str, role: str = "the running kernel"):
    """Fail the host unless ``linux-headers-<kernel>`` is installed or installable (apt has a
    candidate), before the driver is installed: DKMS needs them to build the module.

    + kernel: the kernel's release (``uname -r`` of the running one)
    + role: which kernel it is, for the message ("the kernel that boots next")
    """
    _check_release(kernel)
    if not re.fullmatch(r"[a-z ]+", role):
        raise OperationValueError(f"kernel role {role!r}")
    package = f"linux-headers-{kernel}"
    yield StringCommand(
        f"c=$(apt-cache policy {package} | sed -n 's/^ *Candidate: *//p'); "
        f"if [ -z \"$c\" ] || [ \"$c\" = '(none)' ]; then echo \"no kernel headers for "
        f"{role} {kernel}: apt has no installable {package}; DKMS could not build the "
        "NVIDIA module. Install the headers or boot a kernel that has them, then run again\" "
        ">&2; exit 1; fi; echo \"$c\""
    )


def _check_release(kernel: str) -> None:
    if not re.fullmatch(r"[0-9][a-z0-9.+-]*", kernel):
        raise OperationValueError(f"kernel release {kernel!r}")


@operation()
def module_built(kernel: str, built: bool = False):
    """Make sure DKMS installed the NVIDIA kernel module for ``kernel`` (a kernel installed but
    not booted yet), before a reboot boots it: where :data:`DKMS_MODULE` is missing, ``dkms
    autoinstall -k <kernel>`` builds every AUTOINSTALL module for it (dkms(8)); fails the host
    when there is still none.

    + kernel: the kernel's release
    + built: the module is there already (:class:`KernelHeaders` ``next_module``)

    DKMS usually built it already: the driver's postinst builds for the running and the newest
    installed kernel (dkms_common.postinst), and its /etc/kernel/header_postinst.d hook for a
    kernel whose headers arrive later.
    """
    _check_release(kernel)
    if built:
        host.noop(f"NVIDIA module built for kernel {kernel}")
        return
    module = DKMS_MODULE.format(kernel=kernel)
    yield StringCommand(
        f"if ! ls {module}* >/dev/null 2>&1; then "
        "if ! command -v dkms >/dev/null 2>&1; then echo \"dkms is not installed: no NVIDIA "
        f"module for {kernel}\" >&2; exit 1; fi; dkms autoinstall -k {kernel}; fi; "
        f"if ! ls {module}* >/dev/null 2>&1; then echo \"DKMS built no NVIDIA module for kernel "
        f"{kernel} (no {module}): the next boot would have no driver; see dkms status and "
        f"/var/lib/dkms/nvidia/*/build/make.log\" >&2; exit 1; fi"
    )


@operation(is_idempotent=False)
def booted_kernel_module(expected: str):
    """Check, after a reboot, that the kernel that booted has DKMS's NVIDIA module
    (:data:`DKMS_MODULE`); says which kernel booted, and warns when it is not ``expected``
    (the kernel that boots next, :class:`KernelHeaders`). Fails the host naming the kernel
    otherwise, before the driver's own check.

    + expected: the release the reboot was to boot
    """
    _check_release(expected)

    @remote.callback("the booted kernel's check")
    def check(state, host):
        _ok, out = remote.shell(host, "k=$(uname -r); echo \"$k\"; "
                                      f"ls {DKMS_MODULE.format(kernel='$k')}* 2>/dev/null")
        lines = [line.strip() for line in out.stdout_lines if line.strip()]
        booted = lines[0] if lines else "?"
        if booted != expected:
            logger.warning(f"{host.print_prefix}NVIDIA: booted kernel {booted}, not {expected} "
                           "(the newest installed): see GRUB_DEFAULT in /etc/default/grub")
        if len(lines) < 2:
            raise OperationError(
                f"the booted kernel {booted} has no NVIDIA module "
                f"({DKMS_MODULE.format(kernel=booted)} missing): install "
                f"linux-headers-{booted}, run dkms autoinstall -k {booted} and reboot, or boot "
                "a kernel that has the module")
        logger.info(f"{host.print_prefix}NVIDIA: booted kernel {booted} has the NVIDIA module "
                    f"({lines[1]})")
        return True

    yield FunctionCommand(check, (), {})

