"""bench server's parts that need no server: the workload, one streamed answer, /metrics, the
checks of the answers, the verdicts, the arms' launch arguments, and its options."""

from __future__ import annotations

import json
import os
import time

import pytest

from umbp_nvme.bench import server as S
from umbp_nvme.bench import server_launch as L
from umbp_nvme.bench.server_workload import (CHANGED_AT, check_answers, l3_servable, make_workload, metrics_delta,
                                             parse_answer, parse_metrics, summarize, verdicts)


def test_workload_orders_fill_then_resent_and_fresh_alternating_then_changed():
    w = make_workload(seed=1, prompt_tokens=200, fill=5, resend=3, fresh=2)
    assert [r["name"] for r in w] == ["fill0", "fill1", "fill2", "fill3", "fill4", "resent0", "fresh0",
                                      "resent1", "fresh1", "resent2", "changed0"]
    fills = {r["name"]: r["ids"] for r in w if r["phase"] == "fill"}
    assert all(len(r["ids"]) == 200 and min(r["ids"]) >= 3 for r in w)
    assert len({tuple(ids) for ids in fills.values()}) == 5  # distinct
    for r in w:
        if r["phase"] == "resent":
            assert r["ids"] == fills[r["of"]]
    fresh = [r["ids"] for r in w if r["phase"] == "fresh"]
    assert not {tuple(f) for f in fresh} & {tuple(f) for f in fills.values()}
    changed = w[-1]["ids"]
    diff = [i for i, (a, b) in enumerate(zip(changed, fills["fill0"])) if a != b]
    assert diff == [CHANGED_AT] and 3 <= changed[CHANGED_AT] < 32000


def test_workload_is_reproducible_and_rejects_bad_sizes():
    assert make_workload(seed=7, prompt_tokens=64, fill=2, resend=1, fresh=1) == \
        make_workload(seed=7, prompt_tokens=64, fill=2, resend=1, fresh=1)
    with pytest.raises(ValueError, match="resend"):
        make_workload(seed=1, prompt_tokens=64, fill=2, resend=3, fresh=0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        make_workload(seed=1, prompt_tokens=4, fill=2, resend=1, fresh=0)


def _chunk(t, ids, details=None, cached=0, prompt=2000):
    return (t, {"output_ids": ids, "meta_info": {"prompt_tokens": prompt, "cached_tokens": cached,
                                                 "cached_tokens_details": details, "storage_prefetch_wait": 0.01,
                                                 "queue_time": 0.2}})


def test_parse_answer_takes_ttft_from_the_first_chunk_and_the_rest_from_the_last():
    a = parse_answer([_chunk(10.5, [7]), _chunk(11.0, [7, 8]),
                      _chunk(12.0, [7, 8, 9], {"device": 64, "host": 0, "storage": 1920, "storage_backend": "dynamic"}, 1984)],
                     sent_at=10.0)
    assert a["ttft_s"] == pytest.approx(0.5) and a["e2e_s"] == pytest.approx(2.0)
    assert a["output_ids"] == [7, 8, 9] and a["cached_tokens"] == 1984
    assert (a["device_tokens"], a["host_tokens"], a["storage_tokens"]) == (64, 0, 1920)
    assert a["storage_backend"] == "dynamic" and a["prompt_tokens"] == 2000
    assert a["prefetch_wait_s"] == pytest.approx(0.01) and a["queue_s"] == pytest.approx(0.2)


def test_parse_answer_reads_null_details_as_nothing_cached_and_rejects_errors():
    a = parse_answer([_chunk(1.0, [5])])
    assert a["storage_tokens"] == a["host_tokens"] == a["device_tokens"] == 0
    with pytest.raises(ValueError, match="no data chunk"):
        parse_answer([])
    with pytest.raises(ValueError, match="error"):
        parse_answer([(1.0, {"error": {"message": "boom"}})])


METRICS_TEXT = """# HELP sglang:storage_prefetch_hit_tokens_total x
sglang:storage_prefetch_hit_tokens_total{model_name="m"} 3968.0
sglang:prefill_effective_tokens_total{mode="storage_hit",model_name="m"} 3900.0
sglang:prefill_effective_tokens_total{mode="device_hit",model_name="m"} 64.0
umbp_nvme_gets_total{drive="0"} 100.0
umbp_nvme_gets_total{drive="1"} 24.0
umbp_nvme_hits_total 120
umbp_nvme_puts_total nan_is_not_a_number
"""


def test_parse_metrics_sums_labels_and_filters_the_storage_hit_mode():
    m = parse_metrics(METRICS_TEXT)
    assert m["storage_prefetch_hit_tokens"] == 3968.0
    assert m["storage_hit_prefill_tokens"] == 3900.0  # not the device_hit sample
    assert m["umbp_gets"] == 124.0 and m["umbp_hits"] == 120.0
    assert m["umbp_puts"] == 0.0 and m["hicache_backup_bytes"] == 0.0  # unparsable / absent
    assert metrics_delta({"umbp_gets": 24.0}, m)["umbp_gets"] == 100.0


def _rec(phase, name, out, storage=0, of=None, ttft=0.5, cached=None, prompt=2000):
    return {"phase": phase, "name": name, "of": of, "output_ids": out, "ttft_s": ttft, "e2e_s": ttft + 1,
            "prompt_tokens": prompt, "cached_tokens": storage if cached is None else cached,
            "storage_tokens": storage, "host_tokens": 0, "device_tokens": 0}


def test_check_answers_counts_l3_hits_identical_outputs_and_the_changed_prompt():
    recs = [_rec("fill", "fill0", [1, 2]), _rec("fill", "fill1", [3, 4]),
            _rec("resent", "resent0", [1, 2], storage=1984, of="fill0"),
            _rec("resent", "resent1", [3, 5], storage=1920, of="fill1"),  # one page short, other output
            _rec("resent", "resent2", [1, 2], storage=960, of="fill0", prompt=1024),  # 1,024 = 16 pages: 15 served
            _rec("changed", "changed0", [9, 9], of="fill0"),
            {"phase": "fresh", "name": "fresh0", "of": None, "error": "boom"}]
    c = check_answers(recs, 64)
    assert c == {"resent": 3, "resent_identical": 2, "resent_l3": 2, "changed_uncached": 1,
                 "changed_differs": 1, "errors": 1}


def test_l3_servable_is_every_full_page_short_of_the_last_token():
    assert [l3_servable(n, 64) for n in (2000, 1024, 1025, 64, 63)] == [1984, 960, 1024, 0, 0]


def test_summarize_medians_per_phase_and_prefill_rate_of_uncached_tokens():
    recs = [_rec("fresh", f"f{i}", [1], ttft=t) for i, t in enumerate((0.5, 1.0, 2.0))]
    recs.append(_rec("resent", "r0", [1], storage=1984, ttft=0.25))
    s = summarize(recs)
    assert s["fresh"]["n"] == 3 and s["fresh"]["ttft_ms"] == pytest.approx(1000.0)
    assert s["fresh"]["prefill_tok_s"] == pytest.approx(2000.0)
    assert s["resent"]["storage_tokens"] == 1984 and s["resent"]["prefill_tok_s"] == pytest.approx(16 / 0.25)
    assert "fill" not in s


def _round(umbp_fresh, l2_fresh, umbp_resent, file_resent, none_resent, checks=None):
    def arm(fresh, resent):
        return {"summary": {"fresh": {"ttft_ms": fresh}, "resent": {"ttft_ms": resent}}}
    r = {"arms": {"umbp": arm(umbp_fresh, umbp_resent), "l2": arm(l2_fresh, 1), "file": arm(1, file_resent),
                  "none": arm(1, none_resent)}}
    if checks:
        r["arms"]["umbp"]["checks"] = checks
    return r


def test_verdicts_take_medians_of_per_round_ratios_and_skip_failed_arms():
    ok = {"resent": 10, "resent_l3": 10, "resent_identical": 10}
    rounds = [_round(100, 100, 40, 100, 100, ok), _round(120, 100, 50, 50, 100, ok), _round(90, 100, 30, 60, 100, ok),
              {"arms": {"umbp": {"error": "died"}}}]
    v = {x["target"]: x for x in verdicts(rounds)}
    fresh = v["fresh TTFT umbp / l2"]
    assert fresh["value"] == pytest.approx(1.0) and fresh["rounds"] == 3 and fresh["met"] is True
    by_file = v["L3-served TTFT umbp / file"]
    assert by_file["value"] == pytest.approx(0.5) and by_file["met"] is True
    assert v["L3-served TTFT umbp / recompute (none, resent)"]["value"] == pytest.approx(0.4)
    assert v["umbp: re-sent prompts L3 hits with identical outputs, every round"]["met"] is True


def test_verdicts_give_the_l3_threads_cpu_share_as_a_median_over_rounds():
    rounds = []
    for umbp_rest, l2_rest in ((2.0, 1.0), (1.5, 1.4), (9.0, 1.0)):
        r = _round(100, 100, 40, 100, 100)
        r["arms"]["umbp"]["server_cpu"] = {"cpu_s": 100.0, "rest_s": umbp_rest}
        r["arms"]["l2"]["server_cpu"] = {"cpu_s": 90.0, "rest_s": l2_rest}
        rounds.append(r)
    v = {x["target"]: x for x in verdicts(rounds)}
    share = v["L3 threads' CPU share of the server (umbp beside-forward-pass CPU - l2's) / umbp CPU"]
    assert share["value"] == pytest.approx(0.01) and share["rounds"] == 3 and share["met"] is True
    rounds[1]["arms"]["umbp"]["server_cpu"]["rest_s"] = 5.0  # now 0.01, 0.036, 0.08: median 0.036
    share = {x["target"]: x for x in verdicts(rounds)}[share["target"]]
    assert share["value"] == pytest.approx(0.036) and share["met"] is False


def test_process_cpu_reads_this_process_and_its_threads():
    import threading
    from umbp_nvme.bench.server_client import process_cpu
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        t0 = time.process_time()
        while time.process_time() - t0 < 0.3:
            pass
        got = process_cpu(os.getpid())
    finally:
        stop.set()
        t.join()
    assert got["threads"] >= 2 and got["cpu_s"] >= 0.2 and 0 <= got["rest_s"] <= got["cpu_s"]  # 0.3 s spent; /proc counts whole ticks
    assert process_cpu(2 ** 22 + 7) is None  # no such process


def test_verdicts_fail_when_one_round_missed_an_l3_hit():
    rounds = [_round(100, 100, 40, 100, 100, {"resent": 10, "resent_l3": 9, "resent_identical": 10})]
    v = {x["target"]: x for x in verdicts(rounds)}
    assert v["umbp: re-sent prompts L3 hits with identical outputs, every round"]["met"] is False
    assert verdicts([])[0]["value"] is None and verdicts([])[0]["met"] is None


def test_arm_args_put_the_store_where_each_arm_expects_it(tmp_path):
    kw = dict(model_dir="/m", port=1, store_dir=str(tmp_path))
    umbp, env = S.arm_args("umbp", **kw)
    extra = json.loads(umbp[umbp.index("--hicache-storage-backend-extra-config") + 1])
    assert extra["ssd_storage_dir"] == str(tmp_path) and extra["class_name"] == "UMBPNvmeStore" and env == {}
    file_args, file_env = S.arm_args("file", **kw)
    assert file_args[file_args.index("--hicache-storage-backend") + 1] == "file"
    assert file_env == {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path)}
    l2, _ = S.arm_args("l2", **kw)
    assert "--enable-hierarchical-cache" in l2 and "--hicache-storage-backend" not in l2
    none, _ = S.arm_args("none", **kw)
    assert "--enable-hierarchical-cache" not in none and "--enable-cache-report" in none
    with pytest.raises(ValueError, match="unknown arm"):
        S.arm_args("nvme", **kw)


def test_server_env_sets_the_shims_and_the_omp_policy_only_when_asked(tmp_path):
    env = L.server_env({"PYTHONPATH": "/x", "OMP_WAIT_POLICY": "ACTIVE"}, ext_dir=str(tmp_path))
    parts = env["PYTHONPATH"].split(":")
    assert parts[:2] == [L.CPU_SHIMS_DIR, L.SHIMS_DIR] and "/x" in parts
    assert env["TORCH_EXTENSIONS_DIR"] == str(tmp_path) and env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert "OMP_WAIT_POLICY" not in env  # "default" means the runtime's own default
    assert L.server_env({}, ext_dir="/e", omp_wait_policy="PASSIVE")["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "UMBP_SGLANG_CPU_SHIMS" not in L.server_env({}, ext_dir="/e", cpu_shims=False)


@pytest.mark.parametrize("argv, message", [
    (["--arms", "umbp,nvme"], "unknown arm"),
    (["--omp-wait-policy", "LAZY"], "--omp-wait-policy"),
    (["--crash-after", "30"], "--crash-after"),
])
def test_bad_options_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit):
        S.parse_args(argv)
    assert message in capsys.readouterr().err


def test_quick_options_shrink_the_run():
    cfg = S.parse_args(["--quick", "--omp-wait-policy", "passive"])
    assert (cfg.rounds, cfg.fill, cfg.resend, cfg.fresh) == (1, 14, 4, 4) and cfg.omp_policy_env == "PASSIVE"
    assert S.parse_args([]).rounds == 3 and S.parse_args(["--arms", "umbp,file"]).arms == ["umbp", "file"]
