"""The P2P decision table (operations/plans/p2p_policy.py)."""

import pytest

from operations.plans.p2p_policy import NO_P2P_ENV, P2P_DISABLED_ENV, decide, env_file


def m(n, code):
    return [["X" if i == j else code for j in range(n)] for i in range(n)]


def test_single_gpu_has_no_pairs():
    d = decide(m(1, "OK"), m(1, "OK"))
    assert d.p2p == "n/a" and "no GPU pairs" in d.reason
    assert d.server_args == ()


def test_reference_vm_all_ns_gives_the_reference_launch():
    d = decide(m(8, "NS"), m(8, "NS"))
    assert d.p2p == "off"
    assert d.env == {
        "NCCL_IB_DISABLE": "1",
        "NCCL_P2P_LEVEL": "PHB",
        "NCCL_ALLOC_P2P_NET_LL_BUFFERS": "1",
        "NCCL_MIN_NCHANNELS": "8",
    }
    assert d.server_args == ("--disable-custom-all-reduce",)
    assert "NS" in d.reason


@pytest.mark.parametrize("code", ["CNS", "GNS", "TNS", "NS", "U"])
def test_any_unsupported_code_turns_p2p_off(code):
    read = m(4, "OK")
    read[1][2] = read[2][1] = code
    d = decide(read, m(4, "OK"))
    assert d.p2p == "off" and code in d.reason


def test_write_matrix_counts_too():
    d = decide(m(2, "OK"), m(2, "CNS"))
    assert d.p2p == "off"


def test_all_ok():
    d = decide(m(8, "OK"), m(8, "OK"), verified=True)
    assert d.p2p == "on" and d.server_args == () and "NCCL_P2P_LEVEL" not in d.env
    assert "verified" in d.reason


def test_ok_but_verification_failed_warns_with_causes():
    d = decide(m(2, "OK"), m(2, "OK"), verified=False)
    assert d.p2p == "off" and d.env == P2P_DISABLED_ENV
    # NCCL would otherwise go peer-to-peer again: the driver still reports P2P OK
    # (tests/fixtures/h200-x2-device/nccl-env.txt).
    assert d.env["NCCL_P2P_DISABLE"] == "1"
    assert NO_P2P_ENV.items() <= d.env.items()
    assert any("ACS" in w and "x-nv-gpudirect-clique" in w for w in d.warnings)


def test_override_contradicting_measurement_warns():
    d = decide(m(2, "NS"), m(2, "NS"), override="on")
    assert d.p2p == "on"
    assert any("contradicts the measurement" in w for w in d.warnings)
    d = decide(m(2, "OK"), m(2, "OK"), verified=True, override="off")
    assert d.p2p == "off" and d.server_args == ("--disable-custom-all-reduce",)
    assert d.env == P2P_DISABLED_ENV


def test_reported_off_keeps_the_reference_launch_exactly():
    d = decide(m(8, "NS"), m(8, "NS"), verified=None)
    assert d.env == NO_P2P_ENV and "NCCL_P2P_DISABLE" not in d.env


def test_override_agreeing_is_silent():
    d = decide(m(2, "NS"), m(2, "NS"), override="off")
    assert d.warnings == ()


def test_bad_input():
    with pytest.raises(ValueError, match="square"):
        decide(m(2, "OK"), m(3, "OK"))
    with pytest.raises(ValueError, match="allowed are 'on', 'off' or None"):
        decide(m(2, "OK"), m(2, "OK"), override="yes")


def test_env_file_splits_flags_into_one_variable():
    text = env_file(decide(m(8, "NS"), m(8, "NS")))
    assert "NCCL_P2P_LEVEL=PHB\n" in text
    assert "GPUHOST_P2P_SERVER_ARGS=--disable-custom-all-reduce\n" in text
    text = env_file(decide(m(8, "OK"), m(8, "OK")))
    assert "GPUHOST_P2P_SERVER_ARGS=\n" in text


def test_manual_table_mirrors_the_policy():
    """The manual's "P2P decision table" (docs/first-deploy.md) is the one place people read it:
    it must say what decide() does."""
    from pathlib import Path

    from operations.plans.p2p_policy import BASE_ENV, NO_P2P_FLAGS

    readme = (Path(__file__).resolve().parents[1] / "docs" / "first-deploy.md").read_text()
    table = readme.split("## P2P decision table", 1)[1].split("\n\n", 3)[2]
    rows = [r for r in table.splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert len(rows) == 4
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    no_p2p = " ".join(f"{k}={v}" for k, v in NO_P2P_ENV.items())
    base = " ".join(f"{k}={v}" for k, v in BASE_ENV.items())
    assert [c[1] for c in cells] == ["n/a", "on", "off", "off"]
    assert cells[0][2] == cells[1][2] == f"`{base}`"
    assert cells[2][2] == f"`{no_p2p}`"
    assert cells[2][3] == " ".join(f"`{f}`" for f in NO_P2P_FLAGS)
    assert cells[3][2] == "as above, and `NCCL_P2P_DISABLE=1`"
    assert decide(m(2, "OK"), m(2, "OK"), verified=False).env == {**NO_P2P_ENV,
                                                                  "NCCL_P2P_DISABLE": "1"}
    assert decide(m(1, "OK"), m(1, "OK")).p2p == "n/a"
    assert decide(m(2, "OK"), m(2, "OK"), verified=True).p2p == "on"
    assert decide(m(2, "TNS"), m(2, "OK")).env == NO_P2P_ENV
    for code in ("NS", "CNS", "GNS", "TNS", "U"):
        assert code in cells[2][0]
