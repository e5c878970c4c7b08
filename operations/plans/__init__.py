"""Decisions: host data read into typed settings, and the pure choices made from facts (driver
plan, P2P policy, memory fit, launch profiles, the fleet's revision)."""
