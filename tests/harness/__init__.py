"""Test harness: real processes, namespaces and containers, cleaned up by recorded PID or name."""
