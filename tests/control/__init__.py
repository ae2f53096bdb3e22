"""Tests of the control plane (controller, processors, protocol, failover, security)."""
