# Typed surface of the compiled core; tests/test_native_stubs.py keeps it true.

def build_info() -> dict[str, object]: ...
def configure_devices(kind: str | None = None, num_cpu_devices: int | None = None) -> None: ...
def device_kind() -> str: ...
def device_count() -> int: ...
def device_total_memory(index: int) -> int: ...
def cuda_available() -> bool: ...

# Planner (csrc/planner/planner.h). profiles: per model (forward_seconds, recompute_seconds,
# backward_seconds, forward_bytes, backward_bytes). Returns {"plans": [(forward, backward)] with
# (begin, end) pairs, "phases": [{"num_stages", "largest_stage_seconds", "objective",
# "predicted_seconds", "tied_plans"}], "objective": float, "predicted_seconds": float}.
def plan_stages(
    run_type: str,
    profiles: list[tuple[list[float], list[float], list[float], list[float], list[float]]],
    min_stages: int,
    upper_threshold: float,
    stage_memory_cap: float,
    num_devices: int,
    num_microbatches: int,
    upload_bytes_per_second: float = 0.0,
) -> dict[str, object]: ...

# Simulator (csrc/planner/simulator.h): (makespan, [(stage, microbatch, device, start, end)]).
def simulate_schedule(
    stage_seconds: list[float],
    num_devices: int,
    num_microbatches: int,
    upload_seconds: list[float] | None = None,
) -> tuple[float, list[tuple[int, int, int, float, float]]]: ...
