"""``scripts/load_test.py``'s memory figures on synthetic traces (no server): a steady
climb shows as a trend, the saw-tooth of periodic heap trims does not."""

from __future__ import annotations

import pytest

from tests.cli.helpers import script_module


@pytest.fixture(scope="module")
def load_test():
    with script_module("load_test") as module:
        yield module


def samples(mb_at, seconds: int = 600, every: int = 3) -> list[tuple[float, float]]:
    return [(float(t), float(mb_at(t))) for t in range(0, seconds + 1, every)]


def test_a_steady_climb_shows_as_its_rate(load_test):
    trace = samples(lambda t: 5000 + 0.5 * t)  # 30 MB a minute
    assert load_test.second_half_slope(trace) == pytest.approx(30.0, abs=0.01)
    assert load_test.second_half_growth(trace) == pytest.approx(150.0, abs=2)


def test_a_trim_saw_tooth_is_flat(load_test):
    """Kept memory builds up for 10 s, then a trim hands 120 MB back: no trend, while
    the end-minus-middle difference depends on where the two samples fall."""
    trace = samples(lambda t: 5000 + 12 * (t % 10))
    assert abs(load_test.second_half_slope(trace)) < 1.0


def test_too_short_a_trace_has_no_trend(load_test):
    assert load_test.second_half_slope([(0.0, 1.0), (3.0, 2.0)]) is None


def test_the_floor_holds_under_a_saw_tooth_and_climbs_with_a_leak(load_test):
    """The lowest RSS of each minute after the warm-up: flat under trims that hand
    back what each step's buffers took, rising with live memory that is never freed."""
    trimmed = samples(lambda t: 5000 + 12 * (t % 10), seconds=900)
    floor = load_test.floor_trend(trimmed, warmup_s=120)
    assert floor["memory_mb_floor_first"] == floor["memory_mb_floor_last"] == 5000
    assert floor["memory_mb_floor_per_min"] == pytest.approx(0.0, abs=0.01)
    leaking = samples(lambda t: 5000 + 12 * (t % 10) + 0.25 * t, seconds=900)
    floor = load_test.floor_trend(leaking, warmup_s=120)
    assert floor["memory_mb_floor_per_min"] == pytest.approx(15.0, abs=1.0)
    assert load_test.floor_trend(trimmed[:10], warmup_s=120)["memory_mb_floor_first"] is None


def test_graft_counters_are_read_from_prometheus_text(load_test):
    text = "\n".join([
        "# HELP vllm:graft_steps_total Steps ...",
        "# TYPE vllm:graft_steps_total counter",
        'vllm:graft_steps_total{engine="0",mode="tree",model_name="m"} 12.0',
        'vllm:graft_steps_total{engine="0",mode="plain",model_name="m"} 30.0',
        'vllm:graft_steps_total{engine="1",mode="plain",model_name="m"} 5.0',
        'vllm:graft_steps_created{engine="0",mode="plain",model_name="m"} 1.7e9',
        'vllm:graft_bookkeeping_seconds_total{engine="0",model_name="m"} 0.25',
        'vllm:num_requests_running{engine="0"} 3.0'])
    assert load_test.parse_graft_counters(text) == {
        "guard_tree_steps": 12.0, "guard_plain_steps": 35.0, "bookkeeping_us": 250000.0}


def test_every_deterministic_answer_is_compared_with_plain_decoding(load_test):
    """Each answer counts, not the last per prompt: one differing answer among several
    to the same request shows."""
    run = load_test.MethodRun("graft")
    run.answers = [(("greedy", 0), "a"), (("greedy", 0), "a"), (("greedy", 0), "b"),
                   (("nonstream", 1), "c"), (("penalties", 2), "d")]
    result = load_test.compare(run, {("greedy", 0): "a", ("nonstream", 1): "c"})
    assert result["deterministic_answers"] == 5
    assert result["deterministic_compared"] == 4
    assert result["deterministic_identical"] == 3
    assert result["mismatches"][0]["stream"] == "greedy"


def test_a_server_is_drained_only_when_nothing_runs_and_graft_tables_are_empty(load_test):
    text = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0',
        'vllm:graft_request_table_entries{engine="0",model_name="m"} 0.0',
        'vllm:graft_request_table_entries{engine="1",model_name="m"} 2.0'])
    values = load_test.scheduler_gauges(text)
    assert values["graft_table_entries"] == 2.0
    assert not load_test.is_drained(values, graft=True)
    assert "2 entries" in load_test.drain_text({**values, "drained": False})
    assert load_test.is_drained(load_test.scheduler_gauges(text.replace(" 2.0", " 0.0")),
                                graft=True)
    plain = text.split("\nvllm:graft_request_table_entries")[0]
    assert load_test.is_drained(load_test.scheduler_gauges(plain), graft=False)
    assert not load_test.is_drained(load_test.scheduler_gauges(plain), graft=True)
    running = plain.replace('model_name="m"} 0.0', 'model_name="m"} 1.0', 1)
    assert not load_test.is_drained(load_test.scheduler_gauges(running), graft=False)


def test_clients_scale_the_streams(load_test):
    assert sum(c for c, _ in load_test.scaled_streams(32).values()) == 30
    assert {n: c for n, (c, _) in load_test.scaled_streams(32).items()} == {
        n: c for n, (c, _) in load_test.STREAMS.items()}
    small = {n: c for n, (c, _) in load_test.scaled_streams(8).items()}
    assert sum(small.values()) == 6 and min(small.values()) >= 1
    with pytest.raises(ValueError, match="--clients"):
        load_test.scaled_streams(4)


def test_reference_answers_survive_a_round_trip_and_a_changed_prompt_is_asked_again(
        load_test, tmp_path):
    prompts = [{"id": 0, "prompt": "a", "output_tokens": 4},
               {"id": 1, "prompt": "b", "output_tokens": 4}]
    reference = {("greedy", 0): "x", ("nonstream", 1): "y"}
    path = tmp_path / "reference.json"
    load_test.save_reference(path, prompts, reference, "m", [])
    assert load_test.load_reference(path, prompts) == reference
    changed = [prompts[0], {**prompts[1], "output_tokens": 8}]
    assert load_test.load_reference(path, changed) == {("greedy", 0): "x"}
