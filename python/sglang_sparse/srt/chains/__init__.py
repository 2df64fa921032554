"""Chain Cache: the scheduler side (lifecycle of a chain's KV) and the HTTP side (response fields)."""
