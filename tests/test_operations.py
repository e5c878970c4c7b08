"""pyinfra-testing specs: one case file per behaviour under tests/operations/<module>.<op>/."""

from pathlib import Path

from pyinfra_testing.operations import make_operation_tests

BASE = Path(__file__).parent / "operations"

for _op in sorted(d.name for d in BASE.iterdir() if d.is_dir()):
    locals()[_op] = make_operation_tests("operations", _op, BASE / _op)
