"""Launch profiles (operations/plans/launch_profiles.py): the default is the best profile the locked
sglang's parser accepts, a named one must fit the host, the user's keys win, and the plan names
the profile, its source and every value it set."""

from dataclasses import fields

import pytest

from operations.plans import launch_profiles
from operations.plans.launch_profiles import PROFILE_SETTINGS, PROFILES, named, report
from operations.plans.settings import Settings, SettingsError, from_host_data, profile_choice
from operations.plans.sglang import check_server_args, load_parser_spec, server_args

LOCK_059 = "sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n"
LOCK_0510 = "sglang==0.5.10 --hash=sha256:" + "0" * 64 + "\n"


@pytest.fixture
def lock(tmp_path):
    def make(text=LOCK_059):
        path = tmp_path / f"lock-{abs(hash(text))}.txt"
        path.write_text(text)
        return str(path)
    return make


def settings(lock_path, **data):
    return from_host_data("gpu1", {"gpuhost_lock": lock_path, **data})


def test_every_value_has_a_reason_and_every_profile_a_source():
    for profile in PROFILES:
        assert profile.source and profile.figure and profile.summary, profile.name
        for value in profile.values:
            assert value.why, (profile.name, value.setting)
            assert value.setting in {f.name for f in fields(Settings)}


def test_the_settings_defaults_are_the_default_profile_of_the_default_lock():
    default = named("field-glm5-sm120-sglang0.5.9").settings()
    for setting in PROFILE_SETTINGS:
        assert getattr(Settings(), setting) == default[setting], setting


def test_sglang_059_gets_the_field_profile_with_its_own_fp4_gemm_backend(lock):
    s = settings(lock())
    assert s.launch_profile == "field-glm5-sm120-sglang0.5.9"
    assert (s.kv_cache_dtype, s.moe_runner_backend, s.fp4_gemm_backend) == \
        ("bf16", "cutlass", "flashinfer_cutlass")
    choice = profile_choice("gpu1", {"gpuhost_lock": lock()})
    ((passed, why),) = choice.passed_over
    assert passed == "field-glm5-sm120"
    assert why.startswith("--fp4-gemm-backend cutlass: sglang 0.5.9 allows only auto, ")


def test_sglang_0510_gets_the_field_profile_as_published(lock):
    s = settings(lock(LOCK_0510))
    assert s.launch_profile == "field-glm5-sm120"
    assert s.fp4_gemm_backend == "cutlass"
    assert profile_choice("gpu1", {"gpuhost_lock": lock(LOCK_0510)}).passed_over == ()


@pytest.mark.parametrize("profile", [p.name for p in PROFILES])
def test_each_profile_accepted_by_a_locked_sglang_renders_what_it_says(lock, profile):
    version = {"field-glm5-sm120": "0.5.10", "field-glm5-sm120-cuda13": "0.5.17"}.get(profile,
                                                                                    "0.5.9")
    s = settings(lock(f"sglang=={version} --hash=sha256:{'0' * 64}\n"),
                 gpuhost_launch_profile=profile)
    check_server_args(server_args(s), load_parser_spec(version))
    for setting, value in named(profile).settings().items():
        assert getattr(s, setting) == value, setting


def test_the_users_keys_win_over_the_profile(lock):
    s = settings(lock(), gpuhost_kv_cache_dtype="fp8_e4m3", gpuhost_server_env={"A": "1"},
                 gpuhost_mem_fraction_static=0.9)
    assert (s.kv_cache_dtype, dict(s.server_env), s.mem_fraction_static) == \
        ("fp8_e4m3", {"A": "1"}, 0.9)
    assert s.moe_runner_backend == "cutlass"  # the profile's, not set by the user
    lines = report(*_report_args(lock(), gpuhost_kv_cache_dtype="fp8_e4m3"), whole=True)
    assert any("your own gpuhost_kv_cache_dtype win over its --kv-cache-dtype bf16" in line
               for line in lines)
    assert not any("sets --kv-cache-dtype" in line for line in lines)


def test_the_parser_checks_a_profile_with_the_users_own_values(lock):
    # The user's FP4 GEMM backend replaces the one value sglang 0.5.9 refuses of the first
    # profile, which then fits.
    s = settings(lock(), gpuhost_fp4_gemm_backend="flashinfer_cudnn")
    assert s.launch_profile == "field-glm5-sm120"
    assert s.fp4_gemm_backend == "flashinfer_cudnn"


def test_the_reference_lab_profile_can_be_named(lock):
    s = settings(lock(), gpuhost_launch_profile="reference-lab")
    assert (s.kv_cache_dtype, s.moe_runner_backend, s.mem_fraction_static) == \
        ("fp8_e4m3", "flashinfer_cutlass", 0.92)


@pytest.mark.parametrize(("data", "message"), [
    ({"gpuhost_launch_profile": "fastest"},
     "gpuhost_launch_profile = 'fastest' is not allowed: one of field-glm5-sm120, "
     "field-glm5-sm120-sglang0.5.9, field-glm5-sm120-cuda13, reference-lab, or None"),
    ({"gpuhost_launch_profile": "field-glm5-sm120"},
     "gpuhost_launch_profile = 'field-glm5-sm120' is not allowed: a profile whose flags the "
     "locked sglang 0.5.9 accepts (--fp4-gemm-backend cutlass: sglang 0.5.9 allows only"),
    ({"gpuhost_launch_profile": "reference-lab", "gpuhost_compute_capability": "9.0"},
     "gpuhost_launch_profile = 'reference-lab' is not allowed: a profile for compute "
     "capability 9.0, gpuhost_model_architecture GlmMoeDsaForCausalLM and the locked sglang "
     "0.5.9 (reference-lab is for compute capability >=12.0,<13.0"),
])
def test_bad_profiles_are_refused_naming_key_value_and_what_is_allowed(lock, data, message):
    with pytest.raises(SettingsError) as err:
        settings(lock(), **data)
    assert message in str(err.value)
    assert str(err.value).startswith("host gpu1: ")


def test_the_reference_lab_profile_is_only_for_sglang_059(lock):
    with pytest.raises(SettingsError) as err:
        settings(lock(LOCK_0510), gpuhost_launch_profile="reference-lab")
    assert "for this host: field-glm5-sm120, or None" in str(err.value)


def test_another_model_gets_no_profile_and_the_plan_says_so(lock):
    s = settings(lock(), gpuhost_model_architecture="LlamaForCausalLM")
    assert s.launch_profile is None
    lines = report(*_report_args(lock(), gpuhost_model_architecture="LlamaForCausalLM"),
                   whole=False)
    assert lines == ["no launch profile for these GPUs, model architecture and sglang 0.5.9: "
                     "the settings' own defaults"]


def test_the_plan_names_the_profile_its_source_and_every_value(lock):
    whole = report(*_report_args(lock()), whole=True)
    assert whole[0].startswith("launch profile field-glm5-sm120-sglang0.5.9 (the first profile "
                               "the locked sglang 0.5.9 accepts; field-glm5-sm120 passed over: "
                               "--fp4-gemm-backend cutlass")
    assert "[source: https://github.com/voipmonitor/rtx6kpro/blob/" in whole[0]
    assert "1010.6 output tok/s" in whole[0]
    profile = named("field-glm5-sm120-sglang0.5.9")
    for value in profile.values:
        shown = launch_profiles.shown(value.setting, value.value)
        assert any(line.startswith(f"launch profile {profile.name} sets {shown} "
                                   f"(gpuhost_{value.setting}): ") for line in whole), shown
    assert any("leaves out --sleep-on-idle" in line for line in whole)
    short = report(*_report_args(lock()), whole=False)
    assert len(short) == 2 and "--kv-cache-dtype bf16" in short[1]
    assert "environment OMP_NUM_THREADS=8 SAFETENSORS_FAST_GPU=1 SGLANG_ENABLE_DEEP_GEMM=0 " \
           "SGLANG_ENABLE_JIT_DEEPGEMM=0" in short[1]


def _report_args(lock_path, **data):
    choice = profile_choice("gpu1", {"gpuhost_lock": lock_path, **data})
    return choice.profile, choice.given, choice.passed_over, choice.sglang, choice.named


def test_the_cuda13_stack_gets_the_field_profile_with_flashinfers_fp4_gemm():
    # gpuhost_cuda_toolkit alone picks locks/cuda13.0.txt (sglang 0.5.17), whose
    # --fp4-gemm-backend has no cutlass: the published profile is passed over, saying why
    s = from_host_data("gpu1", {"gpuhost_cuda_toolkit": "13.0"})
    assert (s.lock, s.launch_profile) == ("locks/cuda13.0.txt", "field-glm5-sm120-cuda13")
    assert (s.fp4_gemm_backend, s.speculative_num_draft_tokens) == ("flashinfer_cutlass", 5)
    choice = profile_choice("gpu1", {"gpuhost_cuda_toolkit": "13.0"})
    ((passed, why),) = choice.passed_over
    assert passed == "field-glm5-sm120"
    assert why.startswith("--fp4-gemm-backend cutlass: sglang 0.5.17 allows only auto, ")


def test_the_plan_says_which_cuda_a_profile_was_measured_on(lock):
    assert {p.name: p.cuda for p in PROFILES} == {
        "field-glm5-sm120": "13.0", "field-glm5-sm120-sglang0.5.9": "13.0",
        "field-glm5-sm120-cuda13": "13.0", "reference-lab": "12.8"}
    on_128 = report(*_report_args(lock()), whole=False, cuda="12.8")
    assert ("launch profile field-glm5-sm120-sglang0.5.9 was measured on CUDA 13.0; this "
            "host's stack is CUDA 12.8 (gpuhost_cuda_toolkit): its figure is not this "
            "stack's") in on_128
    assert report(*_report_args(lock()), whole=False, cuda="13.0") == \
        report(*_report_args(lock()), whole=False)
    lab = report(*_report_args(lock(), gpuhost_launch_profile="reference-lab"), whole=False,
                 cuda="12.8")
    assert not any("was measured on" in line for line in lab)
