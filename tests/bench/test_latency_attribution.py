"""The arithmetic of ``benchmarks/mesh_latency.py --attribute``
(benchmarks/latency_attribution.py): schedstat and Prometheus histogram
parsing, the per-hop table and CPU per request. No mesh, no model."""

from __future__ import annotations

import os
import time

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from benchmarks.latency_attribution import (
    path_order,
    BASE, ENGINE_STEP, ENGINE_THREADS, ROUTER_TTFT, EngineReading, IdleRate, Sample,
    cpu_ms_per_request, cpu_ns, engine_reading, format_hops, histogram_delta,
    histogram_sum_count, hop_rows, idle_rate, multi_step, quartiles, schedstat_ns, scrape,
    thread_mix)


def test_schedstat_is_its_first_field_in_ns() -> None:
    assert schedstat_ns("781140 1896310 1\n") == 781140
    with pytest.raises(ValueError):
        schedstat_ns("")


def test_cpu_ns_counts_this_process_at_ns_precision() -> None:
    before = cpu_ns(os.getpid())
    end = time.process_time() + 0.02
    while time.process_time() < end:  # 20 ms on a CPU: 2 ticks of /proc/PID/stat
        pass
    used = cpu_ns(os.getpid()) - before
    assert 15e6 <= used < 2e9, used
    with pytest.raises(FileNotFoundError):
        cpu_ns(2**22 + 1)  # above pid_max's ceiling: never a process


def test_a_histogram_is_summed_over_its_labels_and_absent_is_zero() -> None:
    registry = CollectorRegistry()
    ttft = Histogram(ROUTER_TTFT, "TTFT.", ["model_name"], registry=registry)
    # a longer name sharing the prefix must not be counted
    Histogram(f"{ROUTER_TTFT}_other", "Other.", registry=registry).observe(9.0)
    text = generate_latest(registry).decode()
    assert histogram_sum_count(text, ROUTER_TTFT) == (0.0, 0)
    ttft.labels("a").observe(0.25)
    ttft.labels("a").observe(0.5)
    before = histogram_sum_count(generate_latest(registry).decode(), ROUTER_TTFT)
    ttft.labels("b").observe(0.125)
    after = histogram_sum_count(generate_latest(registry).decode(), ROUTER_TTFT)
    assert before == (0.75, 2)
    assert after == (0.875, 3)
    assert histogram_delta(before, after) == (0.125, 1)
    assert histogram_sum_count(text, ENGINE_STEP) == (0.0, 0)


def test_an_engine_reading_is_its_step_histogram_and_thread_gauge() -> None:
    registry = CollectorRegistry()
    step = Histogram(ENGINE_STEP, "Step.", registry=registry)
    assert engine_reading(generate_latest(registry).decode()) == EngineReading(0.0, 0, 0)
    Gauge(ENGINE_THREADS, "Threads.", registry=registry).set(2)
    step.observe(0.5)
    step.observe(0.25)
    assert engine_reading(generate_latest(registry).decode()) == EngineReading(0.75, 2, 2)


def _rows() -> dict[str, dict[str, list[float]]]:
    return hop_rows({
        BASE: [Sample(0.010, step_s=0.008), Sample(0.011, step_s=0.009)],
        "mesh (Envoy)": [Sample(0.020, step_s=0.012, router_ttft_s=0.017),
                         Sample(0.030, step_s=0.020, router_ttft_s=0.026)],
        "engine gRPC": [Sample(0.014, step_s=0.011), Sample(0.013, step_s=0.010)],
    })


def test_the_table_is_per_round_differences_in_ms() -> None:
    rows = _rows()
    mesh = rows["mesh (Envoy)"]
    assert mesh["client_ttft"] == pytest.approx([20, 30])
    assert mesh["step"] == pytest.approx([12, 20])
    assert mesh["step_inflation"] == pytest.approx([4, 11])  # paired with in-process's round
    assert mesh["client_minus_step"] == pytest.approx([8, 10])
    assert mesh["ttft_overhead"] == pytest.approx([10, 19])
    assert mesh["outside_overhead"] == pytest.approx([6, 8])  # 8 - 2, 10 - 2
    assert mesh["router_minus_step"] == pytest.approx([5, 6])
    assert mesh["client_minus_router"] == pytest.approx([3, 4])
    assert set(rows[BASE]) == {"client_ttft", "step", "client_minus_step"}
    assert set(rows["engine gRPC"]) == {"client_ttft", "ttft_overhead", "step",
                                        "step_inflation", "client_minus_step",
                                        "outside_overhead"}
    assert rows["engine gRPC"]["client_minus_step"] == pytest.approx([3, 3])


def test_the_columns_add_up_to_the_mesh_overhead_per_round() -> None:
    rows = _rows()
    mesh, base = rows["mesh (Envoy)"], rows[BASE]
    for i in range(2):
        overhead = mesh["client_ttft"][i] - base["client_ttft"][i]
        parts = (mesh["step_inflation"][i] + mesh["router_minus_step"][i]
                 + mesh["client_minus_router"][i] - base["client_minus_step"][i])
        assert parts == pytest.approx(overhead)
        assert mesh["ttft_overhead"][i] == pytest.approx(overhead)
        assert (mesh["step_inflation"][i] + mesh["outside_overhead"][i]
                == pytest.approx(overhead))


def test_the_table_refuses_uneven_rounds_or_no_baseline() -> None:
    with pytest.raises(ValueError, match="round counts"):
        hop_rows({BASE: [Sample(0.01, step_s=0.008)], "mesh": []})
    with pytest.raises(ValueError, match="in-process"):
        hop_rows({"mesh": [Sample(0.01)]})


def test_requests_of_more_than_one_step_are_named() -> None:
    assert multi_step({BASE: [Sample(0.01, step_s=0.008)],
                       "mesh": [Sample(0.02, step_s=0.03, steps=2), Sample(0.02, step_s=0.01),
                                Sample(0.02, step_s=0.0, steps=0)],
                       "no engine": [Sample(0.02, steps=3)]}) == {"mesh": 2}


def test_cpu_per_request_subtracts_the_idle_rate() -> None:
    # 10 ms used over 2 s of 4 requests, idling at 1 ms per second: 2 ms each
    cpu = cpu_ms_per_request(10_000_000, IdleRate(1e6), 2.0, 4)
    assert (cpu.ms, cpu.stderr_ms, cpu.clamped) == (pytest.approx(2.0), 0.0, False)
    # ± the idle rate's standard error over those 2 s, per request: 0.1 ms/s x 2 s / 4
    cpu = cpu_ms_per_request(10_000_000, IdleRate(1e6, 1e5), 2.0, 4)
    assert (cpu.ms, cpu.stderr_ms) == (pytest.approx(2.0), pytest.approx(0.05))
    assert str(cpu) == "2.00±0.05"
    with pytest.raises(ValueError):
        cpu_ms_per_request(1, IdleRate(0.0), 1.0, 0)


def test_the_idle_rate_is_over_all_windows_with_the_standard_error_of_their_rates() -> None:
    rate = idle_rate([(1_000_000, 1.0), (3_000_000, 1.0)])  # 1 and 3 ms/s
    assert rate.ns_per_s == pytest.approx(2e6)
    assert rate.stderr_ns_per_s == pytest.approx(1e6)  # sd sqrt(2) ms/s over sqrt(2)
    assert idle_rate([(3_000_000, 2.0)]) == IdleRate(1.5e6, 0.0)  # one window: no spread
    for windows in ([], [(5, 0.0)]):
        with pytest.raises(ValueError):
            idle_rate(windows)


def test_a_process_that_used_no_more_than_idle_reads_zero_not_a_small_negative() -> None:
    """QA: ``--attribute`` printed -0.03 CPU-ms per request for a process that
    did nothing for the requests: its idle rate, measured apart, came out a
    little above its rate during them. Below 0 within 2 standard errors of
    the idle rate reads 0; further below is kept, since the measurement is then
    off (an idle rate that was not the process's rate during the requests)."""
    # 0.9 ms used over 2 s of 2 requests; idle 0.5 ± 0.05 ms/s: 1.0 ± 0.1 ms expected
    cpu = cpu_ms_per_request(900_000, IdleRate(5e5, 5e4), 2.0, 2)
    assert (cpu.ms, cpu.stderr_ms, cpu.clamped) == (0.0, pytest.approx(0.05), True)
    assert str(cpu) == "0.00±0.05"
    # 0.5 ms used where 1.0 ± 0.1 was expected: 5 standard errors below, kept
    cpu = cpu_ms_per_request(500_000, IdleRate(5e5, 5e4), 2.0, 2)
    assert (cpu.ms, cpu.clamped) == (pytest.approx(-0.25), False)
    # without an error estimate nothing is read as 0
    assert cpu_ms_per_request(900_000, IdleRate(5e5), 2.0, 2).ms == pytest.approx(-0.05)


def test_the_printed_table_has_a_line_per_column_and_a_dash_where_a_path_lacks_it() -> None:
    lines = format_hops(_rows())
    assert lines[0].split() == ["in-process", "mesh", "(Envoy)", "engine", "gRPC"]
    by_key = {line.split()[0]: line for line in lines[1:9]}
    assert by_key["router_minus_step"].split()[1:] == ["-", "5.50", "[5.25-5.75]", "-"]
    assert by_key["step_inflation"].split()[1] == "-"  # in process: the baseline itself
    assert any(line.strip().startswith("client_minus_router: client TTFT - router TTFT")
               for line in lines)


def test_quartiles_are_inclusive_and_a_lone_value_is_its_own_range() -> None:
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (3.0, 2.0, 4.0)
    assert quartiles([7.0]) == (7.0, 7.0, 7.0)


def test_the_thread_mix_counts_requests_per_thread_count_of_paths_with_an_engine() -> None:
    assert thread_mix({BASE: [Sample(0.01, step_s=0.01, threads=2),
                              Sample(0.01, step_s=0.02, threads=1),
                              Sample(0.01, step_s=0.01, threads=2)],
                       "no engine": [Sample(0.02)]}) == {BASE: {2: 2, 1: 1}}


def test_a_scrape_the_server_drops_once_is_tried_again() -> None:
    """A metrics server that closes the first connection without an answer
    (``RemoteDisconnected``, seen once from the router's under load, which
    ended a whole run) is asked again; one that never answers raises."""
    import http.server
    import threading

    calls = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            calls.append(self.path)
            if len(calls) == 1 or self.server.always_drop:  # type: ignore[attr-defined]
                self.close_connection = True
                return  # no status line: the client sees RemoteDisconnected
            body = b"up 1\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.always_drop = False  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        assert scrape(address) == "up 1\n" and len(calls) == 2
        server.always_drop = True  # type: ignore[attr-defined]
        with pytest.raises(OSError):
            scrape(address)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
def test_over_two_cycles_each_path_follows_each_other_equally_often(k: int) -> None:
    """Rotations alone put path B after path A in every round where both run
    (the first mesh always after the in-process run): a position bias."""
    names = [f"p{j}" for j in range(k)]
    follows: dict[tuple[str, str], int] = {}
    for i in range(2 * k):
        order = path_order(names, i)
        assert sorted(order) == names
        for pair in zip(order, order[1:]):
            follows[pair] = follows.get(pair, 0) + 1
    assert len(follows) == k * (k - 1) and len(set(follows.values())) == 1, follows
