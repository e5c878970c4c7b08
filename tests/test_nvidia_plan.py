"""The nvidia stage's decisions (operations.plans.driver_plan.plan_driver), one case per branch:
fresh install, converged, driver change refused or allowed, mismatch, module not loaded, nouveau,
unpackaged drivers, missing kernel headers, duplicate repository entries."""

from pathlib import Path

import pytest

from operations.facts.driver_facts import DriverFiles, Headers, PciGpu, parse_lspci, parse_madison
from operations.facts.nvsmi import DriverState, Gpu
from operations.plans.cuda_repo import KEYRING, AptSource, parse_sources, repo_folder
from operations.plans.driver_plan import plan_driver
from operations.plans.plan import PlanError
from operations.plans.settings import from_host_data

REPO = "http://10.214.1.1:8080/compute/cuda/repos/debian12/x86_64/"
SOURCE = "/etc/apt/sources.list.d/cuda-debian12-x86_64.list"
KERNEL = "6.1.0-26-amd64"
LOCK = Path(__file__).parents[1] / "locks" / "cuda12.8.txt"

GPU = Gpu(0, "NVIDIA H200", "GPU-1", "00000000:00:06.0", "580.95.05", 143771, 700.0, 1980, "9.0")
NO_FILES = DriverFiles(None, None, None)
PKG_FILES = DriverFiles("/usr/bin/nvidia-smi", "nvidia-smi", None)
CONVERGED = {
    "nvidia-open": ["580.95.05-1"],
    "nvidia-kernel-open-dkms": ["580.95.05-1"],
    "cuda-toolkit-12-8": ["12.8.1-1"],
    f"linux-headers-{KERNEL}": ["6.1.0-1"],
}


def settings(**data):
    return from_host_data("gpu1", {"gpuhost_gpu_count": 1, "gpuhost_compute_capability": "9.0",
                                   "gpuhost_tensor_parallel_size": 1, "gpuhost_lock": str(LOCK),
                                   **data})


def plan(s=None, *, debs=None, state=None, files_=PKG_FILES, headers=None, gpus=None,
         sources=None, lists_present=True, available=None):
    return plan_driver(
        s or settings(),
        debs=CONVERGED if debs is None else debs,
        state=state or DriverState("ok", driver_version="580.95.05", gpus=(GPU,)),
        files_=files_,
        headers=headers or Headers(KERNEL, True, "6.1.0-1"),
        gpus=(PciGpu("0000:00:06.0", "nvidia"),) if gpus is None else gpus,
        sources=[AptSource(SOURCE, REPO)] if sources is None else sources,
        repo_url=REPO,
        source_path=SOURCE,
        lists_present=lists_present,
        available=available,
    )


def test_converged_host_changes_nothing():
    p = plan()
    assert not p.install and not p.change and not p.reboot_reasons and not p.refusals
    assert p.summary() == ("driver installed 580.95.05, target newest 580.*; CUDA toolkit "
                           "installed 12.8.1, target 12.8 (cuda-toolkit-12-8); no reboot")


def test_fresh_host_installs_and_reboots():
    p = plan(debs={}, state=DriverState("absent"), files_=NO_FILES, gpus=(),
             headers=Headers(KERNEL, False, None), sources=[], lists_present=False)
    assert p.install and not p.change and not p.refusals
    assert p.headers_unknown  # the repository that has the headers is not configured yet
    assert p.reboot_reasons == ("the driver is installed or changed: its module loads at boot",)
    assert "driver installed none" in p.summary() and "a server restart" in p.summary()


def test_driver_change_is_refused_without_the_flag():
    p = plan(settings(gpuhost_driver_version="580.105.08"))
    assert p.change and p.install
    assert len(p.refusals) == 1
    assert "driver 580.95.05 is installed, host data asks for 580.105.08-*" in p.refusals[0]
    assert "gpuhost_allow_driver_change = True" in p.refusals[0]
    assert p.summary().startswith("driver installed 580.95.05, target 580.105.08 (a driver "
                                  "change)")
    assert "a reboot" in p.summary() and "server restart" in p.summary()


def test_driver_change_with_the_flag_installs_and_reboots():
    p = plan(settings(gpuhost_driver_version="570.172.08", gpuhost_driver_branch="570",
                      gpuhost_allow_driver_change=True))
    assert p.change and p.install and not p.refusals and p.reboot_reasons


def test_branch_only_keeps_an_installed_release_of_the_branch():
    assert not plan(settings(gpuhost_driver_branch="580")).install


def test_mismatch_reboots():
    p = plan(debs={**CONVERGED, "nvidia-kernel-open-dkms": ["580.105.08-1"],
                   "nvidia-open": ["580.105.08-1"]},
             state=DriverState("mismatch", library_version="580.105"))
    assert not p.install and not p.refusals
    assert p.reboot_reasons == (("the loaded module is not the installed driver (NVML 580.105: "
                                "driver/library version mismatch)"),)


def test_module_not_loaded_reboots():
    p = plan(state=DriverState("not-loaded"))
    assert p.reboot_reasons == ("the installed driver's module is not loaded",)


def test_nouveau_holding_a_gpu_reboots():
    p = plan(state=DriverState("not-loaded"), gpus=(PciGpu("0000:00:06.0", "nouveau"),))
    assert "nouveau holds 0000:00:06.0" in p.reboot_reasons


def test_unpackaged_driver_is_refused_by_default():
    files_ = DriverFiles("/usr/local/nvidia/bin/nvidia-smi", None, "580.159.04")
    p = plan(debs={}, files_=files_)
    assert len(p.refusals) == 1 and "no package installed" in p.refusals[0]
    assert "gpuhost_unpackaged_driver = 'keep'" in p.refusals[0]


def test_unpackaged_driver_kept():
    files_ = DriverFiles("/usr/local/nvidia/bin/nvidia-smi", None, "580.159.04")
    p = plan(settings(gpuhost_unpackaged_driver="keep"), debs={}, files_=files_)
    assert p.keep_present and not p.install and not p.refusals and not p.reboot_reasons
    assert p.summary().startswith("driver installed 580.95.05 by no package (kept), target")


def test_unpackaged_driver_kept_but_too_old_for_cuda():
    files_ = DriverFiles("/usr/bin/nvidia-smi", None, None)
    p = plan(settings(gpuhost_unpackaged_driver="keep"), debs={}, files_=files_,
             state=DriverState("ok", driver_version="550.54.15", gpus=(GPU,)))
    assert p.refusals and "older than 570.26, the minimum for CUDA 12.8" in p.refusals[0]


def test_unpackaged_driver_replaced():
    p = plan(settings(gpuhost_unpackaged_driver="replace"), debs={},
             files_=DriverFiles("/usr/bin/nvidia-smi", None, None))
    assert p.install and not p.refusals


def test_no_headers_installable_is_refused_before_any_change():
    p = plan(debs={}, state=DriverState("absent"), files_=NO_FILES,
             headers=Headers(KERNEL, False, None))
    assert len(p.refusals) == 1
    assert f"no kernel headers for the running kernel {KERNEL}" in p.refusals[0]


def test_headers_installable():
    p = plan(debs={}, state=DriverState("absent"), files_=NO_FILES,
             headers=Headers(KERNEL, False, "6.1.0-1"))
    assert not p.refusals and not p.headers_unknown


def test_duplicate_source_entry_is_reported():
    """The same signed-by: apt warns "configured multiple times" and works."""
    same = AptSource("/etc/apt/sources.list", REPO, 3, f"deb [signed-by={KEYRING}] {REPO} /",
                     "/", KEYRING)
    p = plan(sources=[AptSource(SOURCE, REPO, 1, "", "/", KEYRING), same])
    assert len(p.warnings) == 1 and "/etc/apt/sources.list" in p.warnings[0]
    assert not p.refusals
    assert not plan().warnings


MANUAL = "/etc/apt/sources.list.d/cuda-manual.list"
MANUAL_LINE = f"deb [signed-by=/etc/apt/keyrings/cuda.gpg] {REPO} /"
FRESH = {"debs": {}, "state": DriverState("absent"), "files_": NO_FILES, "gpus": (),
         "headers": Headers(KERNEL, False, None), "lists_present": False}


def manual(text=MANUAL_LINE, file=MANUAL, line=1):
    return parse_sources([f"{file}:{line}:{text}"])


def test_a_conflicting_entry_added_by_hand_is_refused_naming_file_and_line():
    p = plan(**FRESH, sources=manual())
    assert len(p.refusals) == 1, p.refusals
    refusal = p.refusals[0]
    assert f"{MANUAL} line 1: {MANUAL_LINE}" in refusal
    assert "signed-by=/etc/apt/keyrings/cuda.gpg" in refusal
    assert "remove that line" in refusal and "gpuhost_cuda_repo_adopt = True" in refusal
    assert not p.adopted


@pytest.mark.parametrize("text", [
    f"deb {REPO} /",  # no signed-by: apt's "Signed-By ... != " conflict
    f"deb [trusted=yes signed-by={KEYRING}] {REPO} /",  # "Conflicting values ... Trusted"
    f"deb-src [signed-by=/etc/apt/keyrings/cuda.gpg] {REPO} /",
    "deb [signed-by=/etc/apt/keyrings/cuda.gpg] " + REPO.replace("http://", "https://") + " /",
    f"deb [signed-by=/etc/apt/keyrings/cuda.gpg] {REPO.rstrip('/')} /",
])
def test_every_entry_apt_takes_for_the_same_source_conflicts(text):
    p = plan(**FRESH, sources=manual(text, "/etc/apt/sources.list", 7))
    assert len(p.refusals) == 1 and "/etc/apt/sources.list line 7" in p.refusals[0]


def test_another_suite_or_repository_is_not_nvidias_entry():
    other = manual(f"deb [signed-by=/x.gpg] {REPO} ./") + manual(
        "deb [signed-by=/x.gpg] http://deb.debian.org/debian bookworm main", line=2)
    p = plan(**FRESH, sources=other)
    assert not p.refusals and not p.warnings


def test_a_deb822_sources_file_is_read_stanza_by_stanza():
    lines = ["Types: deb", "URIs: http://deb.debian.org/debian", "Suites: bookworm",
             "Components: main", "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg",
             "", "Types: deb deb-src", f"URIs: {REPO}", "Suites: /",
             "Signed-By:", " -----BEGIN PGP PUBLIC KEY BLOCK-----", " .", " mQINBF...",
             " -----END PGP PUBLIC KEY BLOCK-----"]
    sources = parse_sources([f"/etc/apt/sources.list.d/cuda.sources:{n}:{t}"
                             for n, t in enumerate(lines, 1)])
    assert [(s.uri, s.line, s.suite) for s in sources] == [
        ("http://deb.debian.org/debian", 2, "bookworm"), (REPO, 8, "/")]
    assert sources[1].signed_by.startswith("-----BEGIN PGP PUBLIC KEY BLOCK-----")
    p = plan(**FRESH, sources=sources)
    assert len(p.refusals) == 1
    assert f"/etc/apt/sources.list.d/cuda.sources line 8: URIs: {REPO}" in p.refusals[0]


def test_a_disabled_deb822_stanza_is_no_entry():
    lines = ["Types: deb", f"URIs: {REPO}", "Suites: /", "Enabled: no",
             "Signed-By: /etc/apt/keyrings/cuda.gpg"]
    assert parse_sources([f"/etc/apt/sources.list.d/cuda.sources:{n}:{t}"
                          for n, t in enumerate(lines, 1)]) == []


def test_adopted_with_host_data_the_entry_is_used_and_none_written():
    p = plan(settings(gpuhost_cuda_repo_adopt=True), **FRESH, sources=manual())
    assert not p.refusals
    assert [s.file for s in p.adopted] == [MANUAL] and p.repo_listed
    assert any("gpuhost writes no entry of its own" in w for w in p.warnings)


def test_adopted_beside_gpuhosts_own_entry_removes_its_own():
    ours = AptSource(SOURCE, REPO, 1, "", "/", KEYRING)
    p = plan(settings(gpuhost_cuda_repo_adopt=True), sources=[ours, *manual()])
    assert not p.refusals and p.adopted
    assert any(f"{SOURCE}, gpuhost's own entry, is removed" in w for w in p.warnings)


def test_two_entries_that_conflict_with_each_other_cannot_be_adopted():
    both = manual() + manual(f"deb [signed-by=/etc/apt/keyrings/other.gpg] {REPO} /",
                             "/etc/apt/sources.list.d/other.list")
    p = plan(settings(gpuhost_cuda_repo_adopt=True), **FRESH, sources=both)
    assert len(p.refusals) == 1 and "Keep one of them" in p.refusals[0]
    assert "cuda-manual.list line 1" in p.refusals[0] and "other.list line 1" in p.refusals[0]


def test_adopt_without_an_entry_writes_gpuhosts_own():
    p = plan(settings(gpuhost_cuda_repo_adopt=True), **FRESH, sources=[])
    assert not p.refusals and not p.adopted
    assert any("no entry lists NVIDIA's repository" in w for w in p.warnings)


def test_the_repository_counts_as_configured_when_adopted():
    """A driver version the adopted repository's lists lack is refused as with gpuhost's own."""
    p = plan(settings(gpuhost_cuda_repo_adopt=True, gpuhost_driver_version="580.105.08"),
             **{**FRESH, "lists_present": True}, sources=manual(), available=("580.95.05-1",))
    assert any("NVIDIA's repository has no nvidia-kernel-open-dkms" in r for r in p.refusals)


@pytest.mark.parametrize(
    ("os_id", "version", "arch", "folder"),
    [("ubuntu", "24.04", "x86_64", "ubuntu2404/x86_64"),
     ("ubuntu", "22.04", "aarch64", "ubuntu2204/sbsa"),
     ("debian", "12", "x86_64", "debian12/x86_64")],
)
def test_repository_table(os_id, version, arch, folder):
    assert repo_folder(os_id, version, arch) == folder


def test_repository_table_refuses_others():
    with pytest.raises(PlanError, match="no NVIDIA CUDA repository for debian 11"):
        repo_folder("debian", "11", "x86_64")
    with pytest.raises(PlanError, match="no NVIDIA CUDA repository for ppc64le"):
        repo_folder("ubuntu", "24.04", "ppc64le")


def test_parse_lspci():
    out = [
        ("0000:00:06.0 3D controller [0302]: NVIDIA Corporation GH100 [H200 SXM 141GB] "
        "[10de:2335] (rev a1)"),
        "\tSubsystem: NVIDIA Corporation Device [10de:18be]",
        "\tKernel driver in use: nouveau",
        "\tKernel modules: nvidiafb, nouveau, nvidia_drm, nvidia",
        "0000:00:07.0 Audio device [0403]: NVIDIA Corporation Device [10de:22e8] (rev a1)",
        "\tKernel driver in use: snd_hda_intel",
        "0000:00:08.0 VGA compatible controller [0300]: NVIDIA Corporation Device [10de:2bb5]",
        "\tKernel modules: nouveau",
        "rc=0",
    ]
    assert parse_lspci(out) == (PciGpu("0000:00:06.0", "nouveau"), PciGpu("0000:00:08.0", None))
    assert parse_lspci(["rc=127"]) is None


def test_pin_and_unattended_exclusions_cover_the_same_packages():
    import re

    import jinja2

    from operations import REPO_ROOT
    pin = jinja2.Template((REPO_ROOT / "templates/apt-nvidia-pin.j2").read_text()).render(
        version_glob="580.95.05-*")
    stanza = [line for line in pin.split("\n\n")[-1].splitlines()
              if line and not line.startswith("#")]
    assert stanza[0].startswith("Package: ") and stanza[1:] == [
        "Pin: version 580.95.05-*", "Pin-Priority: 1000"]
    pinned = [g for g in stanza[0].split()[1:] if not g.startswith("src:")]
    excluded = re.findall(r'"([^"]+)";', (REPO_ROOT / "templates/51gpuhost-unattended-upgrades")
                          .read_text())
    for glob in pinned:
        assert any(glob.rstrip("*").startswith(e) for e in excluded), glob
    assert "cuda-" in excluded
    from sandbox import debian_control
    for name in debian_control.load()["packages"]:  # Debian's real tree of the driver
        assert any(name.startswith(e) for e in excluded), name
        assert any(re.fullmatch(g.replace("*", ".*"), name) for g in pinned), name


@pytest.mark.parametrize(
    ("folder", "flavour", "names"),
    [("debian12/x86_64", "open",
      (["nvidia-open", "nvidia-smi", "libcuda1"], "nvidia-kernel-open-dkms")),
     ("debian12/x86_64", "proprietary",
      (["nvidia-driver", "nvidia-smi", "libcuda1"], "nvidia-kernel-dkms")),
     ("ubuntu2404/x86_64", "open",
      (["nvidia-open", "nvidia-utils-580", "libnvidia-compute-580"], "nvidia-dkms-580-open")),
     ("ubuntu2204/sbsa", "proprietary",
      (["nvidia-driver-580", "nvidia-utils-580", "libnvidia-compute-580"], "nvidia-dkms-580"))],
)
def test_driver_package_names(folder, flavour, names):
    from operations.plans.driver_names import driver_package_names
    assert driver_package_names(folder, flavour, "580") == names


UBUNTU = {
    "nvidia-open": ["580.95.05-0ubuntu1"],
    "nvidia-dkms-580-open": ["580.95.05-0ubuntu1"],
    "cuda-toolkit-12-8": ["12.8.1-1"],
    f"linux-headers-{KERNEL}": ["6.1.0-1"],
}


def test_ubuntu_converged_and_change():
    def ubuntu_plan(s):
        return plan_driver(
            s, debs=UBUNTU, state=DriverState("ok", driver_version="580.95.05", gpus=(GPU,)),
            files_=PKG_FILES, headers=Headers(KERNEL, True, "6.1.0-1"),
            gpus=(PciGpu("0000:00:06.0", "nvidia"),), sources=[], repo_url=REPO,
            source_path=SOURCE, lists_present=True, folder="ubuntu2404/x86_64")
    assert not ubuntu_plan(settings()).install
    changed = ubuntu_plan(settings(gpuhost_driver_version="580.105.08"))
    assert changed.change and changed.refusals
    assert ubuntu_plan(settings(gpuhost_driver_branch="570",
                                gpuhost_allow_driver_change=True)).change


REPO_VERSIONS = ("580.105.08-1", "580.95.05-1", "570.172.08-1")


def test_a_pinned_version_the_repository_lacks_is_refused_naming_what_it_has():
    p = plan(settings(gpuhost_driver_version="580.82.07"), debs={}, state=DriverState("absent"),
             files_=NO_FILES, available=REPO_VERSIONS)
    assert p.install
    assert len(p.refusals) == 1, p.refusals
    assert ("NVIDIA's repository has no nvidia-kernel-open-dkms 580.82.07-* "
            "(gpuhost_driver_branch, gpuhost_driver_version): it has 580.105.08, 580.95.05."
            ) in p.refusals[0]


def test_a_pinned_version_the_repository_has_installs():
    p = plan(settings(gpuhost_driver_version="580.95.05"), debs={}, state=DriverState("absent"),
             files_=NO_FILES, available=REPO_VERSIONS)
    assert p.install and not p.refusals


def test_the_pin_is_not_judged_by_lists_of_an_unconfigured_repository():
    p = plan(settings(gpuhost_driver_version="580.82.07"), debs={}, state=DriverState("absent"),
             files_=NO_FILES, sources=[], available=())
    assert p.install and not p.refusals  # driver_packages checks it once the repository is in


def test_a_converged_host_is_not_refused_when_its_version_left_the_repository():
    p = plan(available=("580.105.08-1",))
    assert not p.install and not p.refusals


def test_madison_versions():
    out = [" nvidia-kernel-open-dkms | 580.105.08-1 | http://r/debian12/x86_64  Packages",
           " nvidia-kernel-open-dkms | 580.95.05-1 | http://r/debian12/x86_64  Packages",
           " nvidia-kernel-open-dkms | 580.95.05-1 | http://mirror/debian12/x86_64  Packages",
           "rc=0"]
    assert parse_madison(out) == ("580.105.08-1", "580.95.05-1")
    assert parse_madison(["rc=127"]) is None


NEXT = "6.1.0-28-amd64"


def test_a_pending_kernel_gets_headers_and_the_module_too_said_in_the_plan():
    p = plan(**{**FRESH, "headers": Headers(KERNEL, False, "6.1.112-1", NEXT, False,
                                            "6.1.119-1")}, sources=[])
    assert not p.refusals and p.next_kernel == NEXT and not p.next_module
    summary = p.summary()
    assert f"kernel {NEXT} boots next (installed, not running yet)" in summary
    assert f"a reboot into kernel {NEXT}" in summary


def test_a_converged_host_with_a_pending_kernel_builds_its_module_without_a_reboot():
    debs = {**CONVERGED, f"linux-headers-{NEXT}": ["6.1.119-1"]}
    p = plan(debs=debs, headers=Headers(KERNEL, True, None, NEXT, True, None, False))
    assert p.next_kernel == NEXT and not p.install and not p.reboot_reasons
    built = plan(debs=debs, headers=Headers(KERNEL, True, None, NEXT, True, None, True))
    assert built.next_module and "its module built already" in built.summary()


def test_no_pending_kernel_no_next_kernel():
    assert plan().next_kernel is None and "boots next" not in plan().summary()


def test_a_pending_kernel_without_installable_headers_is_refused_when_this_run_reboots():
    p = plan(**{**FRESH, "lists_present": True,
                "headers": Headers(KERNEL, True, None, NEXT, False, None)},
             sources=[AptSource(SOURCE, REPO, 1, "", "/", KEYRING)], available=("580.95.05-1",))
    assert len(p.refusals) == 1
    assert f"no kernel headers for the kernel that boots next, {NEXT}" in p.refusals[0]
    assert "the reboot this run makes would boot it without a driver" in p.refusals[0]


def test_a_pending_kernel_without_headers_is_a_warning_when_nothing_reboots():
    p = plan(headers=Headers(KERNEL, True, None, NEXT, False, None))
    assert not p.refusals and not p.reboot_reasons
    assert any("the host's next reboot would come up without a driver" in w
               for w in p.warnings)


def test_a_pending_kernels_headers_are_checked_once_the_repository_is_listed():
    p = plan(**{**FRESH, "headers": Headers(KERNEL, True, None, NEXT, False, None)},
             sources=[])
    assert not p.refusals and p.next_headers_unknown


def test_no_pending_kernel_work_without_a_driver_of_gpuhosts():
    kept = plan(settings(gpuhost_unpackaged_driver="keep"), debs={},
                files_=DriverFiles("/usr/bin/nvidia-smi", None, "580.95.05"),
                headers=Headers(KERNEL, True, None, NEXT, False, None))
    assert kept.keep_present and kept.next_kernel is None


def test_another_grub_default_is_warned_about():
    p = plan(headers=Headers(KERNEL, True, None, NEXT, True, None, True, "saved"))
    assert any("GRUB_DEFAULT=saved" in w for w in p.warnings)
    assert not plan(headers=Headers(KERNEL, True, None, NEXT, True, None, True, "0")).warnings


def test_a_missing_compute_package_installs_without_a_reboot():
    """Debian's nvidia-driver only recommends nvidia-smi (sandbox/data/nvidia-graphics-drivers.
    json): a host converged without it gets it at the pinned version, not a reboot."""
    p = plan(debs={**CONVERGED})
    assert "nvidia-smi" not in CONVERGED
    assert not p.install and not p.reboot_reasons


def test_debian_names_the_compute_packages_and_ubuntu_drops_the_branch_from_590():
    from operations.plans.driver_names import MODULE_PACKAGE_NAMES, driver_package_names

    assert driver_package_names("debian12/x86_64", "open", "580") == (
        ["nvidia-open", "nvidia-smi", "libcuda1"], "nvidia-kernel-open-dkms")
    assert driver_package_names("ubuntu2404/x86_64", "open", "580") == (
        ["nvidia-open", "nvidia-utils-580", "libnvidia-compute-580"], "nvidia-dkms-580-open")
    assert driver_package_names("ubuntu2404/x86_64", "open", "590") == (
        ["nvidia-open", "nvidia-utils", "libnvidia-compute"], "nvidia-dkms-open")
    assert driver_package_names("ubuntu2204/x86_64", "proprietary", "595")[1] == "nvidia-dkms"
    for name in ("nvidia-dkms-open", "nvidia-dkms-580-open", "nvidia-kernel-open-dkms"):
        assert MODULE_PACKAGE_NAMES["open"].fullmatch(name)
        assert not MODULE_PACKAGE_NAMES["proprietary"].fullmatch(name)


def test_ubuntus_rename_removes_the_branch_named_packages_in_the_same_transaction():
    from operations.plans.driver_names import renamed_packages

    debs = {"nvidia-open": ["580.95.05-0ubuntu1"], "nvidia-utils-580": ["580.95.05-0ubuntu1"],
            "libnvidia-compute-580": ["580.95.05-0ubuntu1"],
            "nvidia-dkms-580-open": ["580.95.05-0ubuntu1"]}
    wanted = ["nvidia-open", "nvidia-utils", "libnvidia-compute", "nvidia-dkms-open"]
    assert renamed_packages("ubuntu2404/x86_64", "open", ("580.95.05-0ubuntu1",), debs,
                            wanted) == ["nvidia-utils-580", "libnvidia-compute-580",
                                        "nvidia-dkms-580-open"]
    same = ["nvidia-open", "nvidia-smi", "libcuda1", "nvidia-kernel-open-dkms"]
    assert renamed_packages("debian12/x86_64", "open", ("580.95.05-1",),
                            {n: ["580.95.05-1"] for n in same}, same) == []


def test_a_rollback_checks_the_driver_against_the_module_package_it_reinstalls():
    """Across Ubuntu's 590 rename the kept driver's kernel-module package has another name than
    the new one's: the rollback record names the kept one (a check against the new name would
    find it removed, and call the restored driver broken)."""
    from operations.plans.driver_names import installed_module_package

    ubuntu = {"nvidia-open": ["580.95.05-0ubuntu1"], "nvidia-utils-580": ["580.95.05-0ubuntu1"],
              "nvidia-dkms-580-open": ["580.95.05-0ubuntu1"]}
    assert installed_module_package("open", ubuntu, "nvidia-dkms-open") == "nvidia-dkms-580-open"
    debian = {"nvidia-open": ["580.95.05-1"], "nvidia-kernel-open-dkms": ["580.95.05-1"]}
    assert installed_module_package("open", debian,
                                    "nvidia-kernel-open-dkms") == "nvidia-kernel-open-dkms"
    assert installed_module_package("open", {}, "nvidia-dkms-open") == "nvidia-dkms-open"
