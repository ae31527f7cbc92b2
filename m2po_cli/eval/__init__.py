"""`m2po eval`: the benchmarks, the checkpoints to score, sampling and grading, and the report."""
