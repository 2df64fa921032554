"""Inside the scheduler, around the model: attention backends, forward-step hooks, rows vs logical positions, admission by the MemoryOracle, the KV store."""
