"""Benchmarks that measure turnforge's pieces alone: ``bench_envpool`` (env steps/s of EnvPool
against a single process and Gymnasium's AsyncVectorEnv)."""
