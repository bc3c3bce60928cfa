"""Hardware telemetry for attributing GPU, memory-controller, power and CPU use to
prefill and decode.

Sources (``orin.telemetry.sources``) each read one kind of counter; the sampler
stores their readings on the engine's clock (``time.perf_counter_ns``) so they line
up with step timings.
"""
