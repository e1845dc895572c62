"""Test support (not shipped): pools, byte oracle, crash driver, soak, fuzzers (testing.py), the
fault engine (faults.py), SGLang's real pools and loader (sglang_env.py, sglang_follower.py),
pools without SGLang (standin_pools.py), CLI test stores (cli_stores.py) and a kvikio double
(fake_kvikio.py). Tests import it as ``support`` (tests/ is on sys.path); tools put tests/ on
sys.path first."""
