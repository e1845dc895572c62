"""Test support (not shipped): stand-in host pools and the byte oracle (host_pool.py), the backend
as SGLang builds and calls it (backends.py), the chaos parts -- crash survival (crash_survival.py),
faults through the stack (fault_runs.py), the soak (soak.py), bad-input checkers and fuzz
(bad_input.py), hygiene (hygiene.py) -- the fault engine (faults.py), SGLang's real pools and loader
(sglang_env.py, sglang_follower.py), pools without SGLang (standin_pools.py), CLI test stores
(cli_stores.py) and a kvikio double (fake_kvikio.py). Tests import it as ``support`` (tests/ is on
sys.path); tools put tests/ on sys.path first."""
