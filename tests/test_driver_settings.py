"""Driver and CUDA host data: branch, version, flavour, unpackaged drivers, and the CUDA the
locked torch needs, refused at plan time naming the key, the value and what is allowed."""

import pytest

from operations.plans.lock import read_lock
from operations.plans.settings import CUDA_MIN_DRIVER, SettingsError, from_host_data, torch_cuda

SGLANG = "sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n"


def lock_with(tmp_path, *lines: str) -> str:
    path = tmp_path / "lock.txt"
    path.write_text(SGLANG + "".join(f"{line} --hash=sha256:{'1' * 64}\n" for line in lines))
    return str(path)


def settings(lock, **data):
    return from_host_data("gpu1", {"gpuhost_lock": lock, **data})


def test_torch_cuda_from_local_version_runtime_pin_or_pypi_default(tmp_path):
    assert torch_cuda(read_lock_text(tmp_path, "torch==2.9.1+cu130")) == "13.0"
    assert torch_cuda(read_lock_text(tmp_path, "torch==2.9.1",
                                     "nvidia-cuda-runtime-cu12==12.8.90")) == "12.8"
    assert torch_cuda(read_lock_text(tmp_path, "torch==2.9.1")) == "12.8"
    assert torch_cuda(read_lock_text(tmp_path, "torch==3.0.0")) is None
    assert torch_cuda(read_lock_text(tmp_path)) is None


def read_lock_text(tmp_path, *lines):
    from pathlib import Path
    return read_lock(Path(lock_with(tmp_path, *lines)))


def test_the_real_lock_needs_cuda_12_8():
    from pathlib import Path

    from operations import REPO_ROOT
    assert torch_cuda(read_lock(Path(REPO_ROOT / "locks/cuda12.8.txt"))) == "12.8"


def test_driver_too_old_for_the_locked_torch(tmp_path):
    lock = lock_with(tmp_path, "torch==2.9.1+cu130")
    with pytest.raises(SettingsError) as err:
        settings(lock, gpuhost_driver_branch="575", gpuhost_cuda_toolkit="13.0")
    assert "gpuhost_driver_branch = '575' is not allowed: with gpuhost_cuda_toolkit = '13.0', " \
        "a branch that supports CUDA 13.0 (driver >= 580.65.06)" in str(err.value)
    with pytest.raises(SettingsError) as err:
        settings(lock, gpuhost_driver_version="580.65.05", gpuhost_cuda_toolkit="13.0")
    assert "gpuhost_driver_version = '580.65.05' is not allowed: a driver >= 580.65.06" in str(
        err.value)
    assert settings(lock, gpuhost_driver_version="580.95.05",
                    gpuhost_cuda_toolkit="13.0").driver_version == "580.95.05"
    # the toolkit must be of the locked torch's CUDA major (flash-attn's build)
    with pytest.raises(SettingsError) as err:
        settings(lock, gpuhost_driver_branch="580")
    assert "gpuhost_cuda_toolkit = '12.8' is not allowed: a CUDA 13.x toolkit" in str(err.value)


def test_unknown_torch_cuda_is_refused(tmp_path):
    lock = lock_with(tmp_path, "torch==3.0.0")
    with pytest.raises(SettingsError) as err:
        settings(lock)
    assert "gpuhost_lock" in str(err.value) and "torch 3.0.0 gives none" in str(err.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gpuhost_driver_branch": "550"},
         ("gpuhost_driver_branch = '550' is not allowed: with gpuhost_cuda_toolkit = '12.8', "
          "a branch that supports CUDA 12.8 (driver >= 570.26)")),
        ({"gpuhost_driver_branch": 581},  # a number, as pyinfra's --data gives it
         "gpuhost_driver_branch = '581' is not allowed: one of 535, 550"),
        ({"gpuhost_driver_flavour": "nouveau"},
         "gpuhost_driver_flavour = 'nouveau' is not allowed: one of open, proprietary"),
        ({"gpuhost_driver_version": "580.95"}, None),
        ({"gpuhost_driver_version": 580.95}, None),  # a number, as pyinfra's --data gives it
        ({"gpuhost_driver_version": "latest"},
         "gpuhost_driver_version = 'latest' is not allowed: a driver version such as"),
        ({"gpuhost_driver_version": "580.95.05.1"},
         "gpuhost_driver_version = '580.95.05.1' is not allowed"),
        ({"gpuhost_unpackaged_driver": "overwrite"},
         "gpuhost_unpackaged_driver = 'overwrite' is not allowed: one of refuse, keep, replace"),
        ({"gpuhost_allow_driver_change": "yes"},
         "gpuhost_allow_driver_change = 'yes' is not allowed: True or False"),
        ({"gpuhost_cuda_toolkit": "12.9"},
         "gpuhost_cuda_toolkit = '12.9' is not allowed: one of 12.8, 13.0"),
    ],
)
def test_bad_driver_data(tmp_path, data, message):
    lock = lock_with(tmp_path, "torch==2.9.1")
    if message is None:
        settings(lock, **data)
        return
    with pytest.raises(SettingsError) as err:
        settings(lock, **data)
    assert message in str(err.value)


def test_every_toolkit_has_a_minimum_driver():
    from operations.plans.settings import CUDA_TOOLKITS
    assert set(CUDA_TOOLKITS) <= set(CUDA_MIN_DRIVER)


def test_the_cuda_toolkit_picks_its_stacks_lock_unless_gpuhost_lock_is_set():
    from pathlib import Path

    from operations import REPO_ROOT
    from operations.plans.settings import CUDA_TOOLKITS
    assert set(CUDA_TOOLKITS) == {"12.8", "13.0"}
    assert from_host_data("gpu1", {}).lock == "locks/cuda12.8.txt"
    thirteen = from_host_data("gpu1", {"gpuhost_cuda_toolkit": 13.0})  # as --data gives it
    assert (thirteen.cuda_toolkit, thirteen.lock) == ("13.0", "locks/cuda13.0.txt")
    for cuda, lock in CUDA_TOOLKITS.items():  # each lock's torch is its toolkit's CUDA
        assert torch_cuda(read_lock(Path(REPO_ROOT / lock))) == cuda
    # a lock named in host data wins, and must be of the toolkit's CUDA major
    with pytest.raises(SettingsError) as err:
        from_host_data("gpu1", {"gpuhost_cuda_toolkit": "13.0",
                                "gpuhost_lock": "locks/cuda12.8.txt"})
    assert str(err.value).startswith(
        "host gpu1: gpuhost_cuda_toolkit = '13.0' is not allowed: a CUDA 12.x toolkit: the "
        "locked torch 2.9.1 is built for CUDA 12.8")


@pytest.mark.parametrize(("data", "message"), [
    ({"gpuhost_cuda_toolkit": "13.0", "gpuhost_driver_branch": "570"},
     "host gpu1: gpuhost_driver_branch = '570' is not allowed: with gpuhost_cuda_toolkit = "
     "'13.0', a branch that supports CUDA 13.0 (driver >= 580.65.06): 580, 590; or "
     "gpuhost_cuda_toolkit = '12.8'."),
    ({"gpuhost_cuda_toolkit": "13.0", "gpuhost_driver_branch": "535"},
     "host gpu1: gpuhost_driver_branch = '535' is not allowed: with gpuhost_cuda_toolkit = "
     "'13.0', a branch that supports CUDA 13.0 (driver >= 580.65.06): 580, 590."),
    ({"gpuhost_cuda_toolkit": "13.0", "gpuhost_driver_version": "580.65.05"},
     "host gpu1: gpuhost_driver_version = '580.65.05' is not allowed: a driver >= 580.65.06, "
     "the minimum for CUDA 13.0 (gpuhost_cuda_toolkit)."),
])
def test_the_cuda13_stack_below_the_r580_floor_is_refused_once(data, message):
    # one line per cause: the CUDA 13 lock's torch needs what the toolkit needs, said once
    with pytest.raises(SettingsError) as err:
        from_host_data("gpu1", data)
    assert str(err.value) == message
    assert from_host_data("gpu1", {"gpuhost_cuda_toolkit": "13.0",
                                   "gpuhost_driver_version": "580.65.06"}).driver_branch == "580"


def test_the_issues_name_for_the_cuda_key_points_to_it():
    with pytest.raises(SettingsError) as err:
        from_host_data("gpu1", {"gpuhost_cuda_version": "13.0"})
    assert str(err.value) == ("host gpu1: unknown key gpuhost_cuda_version: did you mean "
                              "gpuhost_cuda_toolkit?")
