"""Test support (not shipped): pools, byte oracle, crash driver, soak, fuzzers (testing.py) and the
fault engine (faults.py). Tests import it as ``support`` (tests/ is on sys.path); tools put tests/
on sys.path first."""
