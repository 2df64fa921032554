"""Prefix-cache pruning: the scheduler side (plan, probe scoring, apply) and the HTTP side (routes)."""
