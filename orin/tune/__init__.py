"""orin-llm tune: measure engine settings against a profile's SLOs and choose.

- ``space.build_space``: the candidate configurations (Candidate) for a profile and model;
- ``search.successive_halving``: the budgeted search, pure (any evaluate function);
- ``measure.EngineMeasurer``: in-process engine measurements with telemetry;
- ``run.tune``: all of it end to end, returning a TuneResult;
- ``tuned.write`` / ``report.write``: the tuned profile YAML and the report.

Nothing is imported here, so the pure search loads without the engine.
"""
