"""Throughput benchmarks: our GRPO trainer against TRL 1.16's GRPOTrainer on the same work (see README.md)."""
