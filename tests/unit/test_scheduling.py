"""tests/scheduling.py: every xdist worker starts with its share of the long tests."""

from __future__ import annotations

from scheduling import balanced_order, walls, worksteal_slices


def test_slices_are_cut_as_worksteal_cuts_them():
    assert worksteal_slices(10, 3) == [3, 3, 4]
    assert worksteal_slices(2, 3) == [0, 1, 1]
    assert sum(worksteal_slices(1395, 3)) == 1395


def test_the_long_tests_are_shared_out_and_each_slice_runs_longest_first():
    times = {"a": 100.0, "b": 90.0, "c": 80.0, "d": 70.0} | {f"s{i}": 1.0 for i in range(8)}
    order = balanced_order(list(times), times.__getitem__, 3)
    slices, start = [], 0
    for size in worksteal_slices(len(order), 3):
        slices.append(order[start:start + size])
        start += size
    heads = [chunk[0] for chunk in slices]
    assert sorted(heads) == ["a", "b", "c"], "each worker starts with one of the three longest"
    assert all([times[t] for t in chunk] == sorted((times[t] for t in chunk), reverse=True) for chunk in slices)
    loads = [sum(times[t] for t in chunk) for chunk in slices]
    assert max(loads) - min(loads) <= 70.0 + 1.0
    assert sorted(order) == sorted(times), "every test once"


def test_a_durations_report_sums_each_tests_phases() -> None:
    report = [
        "============================= slowest durations =============================",
        "53.87s setup    tests/integration/test_g.py::test_greedy",
        "47.26s call     tests/integration/test_g.py::test_greedy",
        "0.01s teardown tests/integration/test_g.py::test_greedy",
        "26.90s call     tests/integration/test_demo.py::test_stops[provenance.json-actor--differs (digest mismatch)]",
        '{"test": "tests/unit/test_a.py::test_b", "wall": 2.5}',
        "1712 passed in 728.01s (0:12:08)",
    ]
    assert walls(report) == {
        "tests/integration/test_g.py::test_greedy": 53.87 + 47.26 + 0.01,
        "tests/integration/test_demo.py::test_stops[provenance.json-actor--differs (digest mismatch)]": 26.90,
        "tests/unit/test_a.py::test_b": 2.5,
    }
