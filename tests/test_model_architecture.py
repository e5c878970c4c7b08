"""The model's architecture: config.json read as sglang reads it (a list, a string, missing),
and the download that finds another architecture than host data says fails right there,
before the server stage writes the unit or restarts the server."""

import json
import subprocess
import sys
import textwrap

import pytest

from operations import REPO_ROOT
from operations.plans.stack_check import model_architecture
from operations.files.model_config import architecture, mismatch

FILES = REPO_ROOT / "operations" / "files"
CONFIG = "/opt/gpuhost/models/org/model/config.json"


def test_a_string_architectures_is_the_name_not_its_first_letter():
    assert model_architecture('{"architectures": "GlmMoeDsaForCausalLM"}') \
        == "GlmMoeDsaForCausalLM"
    line = mismatch('{"architectures": "GlmMoeDsaForCausalLM"}', CONFIG, "DeepseekV3ForCausalLM")
    assert line is not None
    assert "names the architecture GlmMoeDsaForCausalLM (\"architectures\" is a string" in line
    assert "set it to 'GlmMoeDsaForCausalLM'" in line
    assert "gpuhost_model_architecture = 'DeepseekV3ForCausalLM'" in line


@pytest.mark.parametrize(("text", "says"), [
    ('{"model_type": "glm"}', 'has no "architectures"'),
    ('{"architectures": []}', 'has an empty "architectures" list'),
    ('{"architectures": ""}', 'has an empty "architectures"'),
    ('{"architectures": null}', 'has no "architectures"'),
    ('{"architectures": {"a": 1}}', 'has "architectures" of type dict, not a list'),
    ('{"architectures": [3]}', 'has "architectures"[0] = 3, not a name'),
    ("[1, 2]", "is not a JSON object"),
    ("{", "is not JSON"),
])
def test_a_config_json_naming_no_architecture_is_said_so(text, says):
    assert architecture(text)[0] is None
    line = mismatch(text, CONFIG, "GlmMoeDsaForCausalLM")
    assert line is not None and f"the model's {CONFIG} {says}" in line
    assert "gpuhost_model_architecture = 'GlmMoeDsaForCausalLM'" in line
    assert "set it to" not in line


def test_a_list_names_its_first_entry_and_a_match_is_no_mismatch():
    text = json.dumps({"architectures": ["GlmMoeDsaForCausalLM", "Other"]})
    assert architecture(text) == ("GlmMoeDsaForCausalLM", "")
    assert mismatch(text, CONFIG, "GlmMoeDsaForCausalLM") is None


FAKE_HUB = '''
import json, os
CONFIG = json.dumps({"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"})
class _File:
    def __init__(self, name, size):
        self.rfilename, self.size = name, size
class _Info:
    sha = "0123456789abcdef0123456789abcdef01234567"
    siblings = [_File("config.json", len(CONFIG)), _File("model-00001.safetensors", 1000)]
class HfApi:
    def __init__(self, endpoint=None, token=None):
        pass
    def model_info(self, repo, revision=None, files_metadata=False):
        return _Info()
def snapshot_download(repo, revision=None, local_dir=None, token=None, endpoint=None):
    with open(os.path.join(local_dir, "config.json"), "w") as f:
        f.write(CONFIG)
    with open(os.path.join(local_dir, "model-00001.safetensors"), "wb") as f:
        f.write(b"x" * 1000)
'''


def _fetch(tmp_path, *extra):
    fake = tmp_path / "fake" / "huggingface_hub"
    (fake / "utils").mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text(textwrap.dedent(FAKE_HUB))
    (fake / "utils" / "__init__.py").write_text("class HfHubHTTPError(Exception):\n    pass\n")
    dest = tmp_path / "models" / "org" / "model"
    result = subprocess.run(
        [sys.executable, str(FILES / "model_fetch.py"), "--repo", "org/model", "--revision",
         "main", "--dest", str(dest), "--endpoint", "http://127.0.0.1:9", "--headroom-gib", "0",
         *extra],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "fake")},
        capture_output=True, text=True, check=False)
    return result, dest


def test_a_download_naming_another_architecture_fails_the_host_naming_key_and_values(tmp_path):
    result, dest = _fetch(tmp_path, "--architecture", "DeepseekV3ForCausalLM")
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert line == (f"refused: the model's {dest}/config.json names the architecture "
                    "GlmMoeDsaForCausalLM, host data says gpuhost_model_architecture = "
                    "'DeepseekV3ForCausalLM': set it to 'GlmMoeDsaForCausalLM', which the known "
                    "behaviour is matched against")
    # The copy is complete: the next run's planning reads the same config.json.
    assert (dest / ".gpuhost-model.json").is_file()


def test_a_download_naming_host_datas_architecture_passes(tmp_path):
    result, _ = _fetch(tmp_path, "--architecture", "GlmMoeDsaForCausalLM")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
