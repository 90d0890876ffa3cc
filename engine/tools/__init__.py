"""Tools built on the engine: benchmarks, A/B comparison, trace replay, telemetry,
early-exit calibration and the system probes. The decode core never imports them."""
