"""tools/admission_bound.py: per-class reuse rates counted by hand on a tiny trace, and the
hindsight rule's decisions (admit a class whose rate clears the threshold, else on the second
write) checked in the simulator against counts worked out in the comments."""

from __future__ import annotations

import json

from umbp_nvme.bench import trace_sim
from support.traces import load_tool, trace_of

bound = load_tool("admission_bound")


# [0,1] [0,1,2] [3] [0,1,2]: request 0 writes 2 new blocks (size class 2), requests 1 and 2 one
# each (class 1). Blocks 0 and 1 are used again (class 2: 2 of 2); 2 is used again, 3 never
# (class 1: 1 of 2).
REQS = [[0, 1], [0, 1, 2], [3], [0, 1, 2]]


def test_class_rates_count_first_time_blocks_used_again():
    t = trace_of(REQS)
    feats = bound.features(t, [10, 10, 10, 5000])
    assert feats["size"] == [2, 1, 1, 0]
    assert feats["output"] == [4, 4, 4, 12]
    assert bound.class_rates(t, trace_sim.next_use(t), feats["size"]) == {2: 1.0, 1: 0.5}


def test_hindsight_rule_admits_by_class_else_on_second_write():
    t = trace_of(REQS)
    cls = bound.features(t, [0] * 4)["size"]
    rates = bound.class_rates(t, trace_sim.next_use(t), cls)
    # threshold 0.6: class 2 (rate 1.0) is admitted, class 1 (0.5) only on a second write.
    # r0 writes 0,1; r1 hits 0,1 and declines 2 (first offer); r2 declines 3; r3 hits 0,1 and
    # writes 2 (its second offer). Hits 4 of 9 blocks, 3 written, 2 declined.
    r = trace_sim.simulate(t, trace_sim.LRU(10, bound.HindsightClass(cls, rates, 0.6)))
    assert (r.hit_blocks, r.total_blocks, r.written, r.declined) == (4, 9, 3, 2)
    # threshold 0.4 admits both classes: LRU exactly (r3 also hits 2).
    r = trace_sim.simulate(t, trace_sim.LRU(10, bound.HindsightClass(cls, rates, 0.4)))
    assert (r.hit_blocks, r.written, r.declined) == (5, 4, 0)


def test_main_prints_one_line_per_capacity(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(r), "output_length": 7,
                                        "hash_ids": r}) + "\n" for i, r in enumerate(REQS)))  # fmt: skip
    assert bound.main(["--trace", str(path), "--capacity", "2,10"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("t.jsonl: 4 requests")
    assert [line.split(":")[0] for line in out[1:]] == ["2 blocks", "10 blocks"]
    assert "perfect admission" in out[1] and "size in hindsight" in out[1] and "output in hindsight" in out[1]
